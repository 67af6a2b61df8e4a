"""slimkit: small, composable structured-compression primitives for transformer language models.

Public API, the same as the command line's: :class:`Recipe`, :func:`run`, :func:`compress`, :func:`evaluate`,
:func:`load`, :func:`save` and :func:`load_source`.

Method note: docs/methods/engine.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# transformers' own bars (loading, writing shards, GGUF de-quantising) are noise next to slimkit's.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from slimkit.primitives.evaluate.eval_settings import PERPLEXITY_MAX_TOKENS, PERPLEXITY_SEQ_LEN

__version__ = "0.1.0"

__all__ = [
    "Recipe",
    "Result",
    "__version__",
    "compress",
    "evaluate",
    "export",
    "load",
    "load_source",
    "run",
    "save",
]


def run(
    recipe,
    out=None,
    *,
    model=None,
    tokenizer=None,
    force: bool = False,
    evaluate: bool = True,
    compare_dense: bool = True,
    overrides=None,
    tracker=None,
):
    """Run a recipe (a :class:`Recipe`, a bundled name, a YAML path (``str``, ``os.PathLike`` or ``bytes``) or a
    mapping); returns a ``Result``.

    ``out``: also write ``out/model``, ``out/report.json``, ``out/report.md`` (None: nothing is written).
    ``model``/``tokenizer``: compress this in-memory model instead of the recipe's source.
    ``evaluate``: run the recipe's evaluations; ``compare_dense``: with them, the dense model's metrics under the same
    settings (measured once per source and settings, then cached) go beside the run's in the report.
    ``overrides``: a list of ``dotted.path=value`` strings, as ``--set`` on the command line (a bare string is refused).
    ``tracker``: progress bars (:class:`slimkit.engine.progress.RichTracker` on a terminal; default none).
    """
    import copy

    from slimkit.engine.run_result import RunOptions
    from slimkit.engine.runner import run as run_recipe
    from slimkit.primitives.errors import SlimkitError
    from slimkit.primitives.io.paths import as_names, as_path, path_text
    from slimkit.recipes.loading import validate
    from slimkit.recipes.schema import Recipe

    overrides = as_names(overrides, "overrides")
    out = None if out is None else as_path(out, "out")
    if isinstance(recipe, (str, bytes, os.PathLike)):
        recipe = Recipe.from_yaml(path_text(recipe, "recipe"), overrides)
    elif not isinstance(recipe, (Recipe, dict)):
        raise SlimkitError(
            f"recipe: expected a Recipe, a bundled recipe name, a YAML path or a mapping, got {type(recipe).__name__}"
        )
    elif isinstance(recipe, dict) or overrides:
        from slimkit.recipes.loading import apply_override

        data = recipe.source() if isinstance(recipe, Recipe) else copy.deepcopy(recipe)
        for assignment in overrides or []:
            apply_override(data, assignment)
        recipe = validate(data, "recipe")
    options = RunOptions(evaluate=evaluate, compare_dense=compare_dense)
    return run_recipe(recipe, out, model=model, tokenizer=tokenizer, force=force, options=options, tracker=tracker)


def compress(
    model,
    out=None,
    *,
    params: float | None = None,
    memory: str | None = None,
    context: int = 4096,
    batch: int = 1,
    speedup: float | None = None,
    runtime: str = "llama.cpp",
    uniform: Sequence[str] = (),
    time_limit: float | None = None,
    compare: Sequence[str] = (),
    force: bool = False,
    evaluate: bool = True,
    compare_dense: bool = True,
    tracker=None,
):
    """The best model under a budget, found by the ``search`` stage (the bundled ``search`` recipe on ``model``, a
    source name or folder, or a ``model:`` mapping); returns a ``Compressed``: ``search`` (the run's ``Result``),
    ``compared`` (each bundled recipe of ``compare`` run at the same parameter ratio, in memory) and ``rows`` (the
    comparison). Budgets (at least one): ``params`` (fraction of the parameters kept), ``memory`` (weights plus the
    KV cache at ``context`` x ``batch``, e.g. ``"2GiB"``), ``speedup`` (over dense in ``runtime``: ``llama.cpp`` or
    ``pytorch``). ``uniform``: sub-blocks (``attention``, ``mlp``) replaced alike in every layer of one shape, for
    runtimes that read one width for every layer. ``time_limit``: seconds for the search. With ``out``: the run's
    folder (``out/search/recipe.yaml`` reproduces the model without searching) and, with ``compare``,
    ``out/compare.md`` and ``out/compare.json``."""
    from pydantic import ValidationError

    from slimkit.primitives.errors import SlimkitError, format_validation_error
    from slimkit.primitives.io.paths import as_names, as_path
    from slimkit.recipes.compress import Compressed, CompressSettings, compress_recipe, run_comparison

    out = None if out is None else as_path(out, "out")
    try:
        settings = CompressSettings(
            params=params,
            memory=memory,
            context=context,
            batch=batch,
            speedup=speedup,
            runtime=runtime,
            uniform=as_names(uniform, "uniform") or [],
            time_limit=time_limit,
            compare=as_names(compare, "compare") or [],
        )
    except ValidationError as error:
        raise SlimkitError(f"compress: {format_validation_error(error)}") from None
    raw = compress_recipe(model, settings)
    searched = run(raw, out, force=force, evaluate=evaluate, compare_dense=compare_dense, tracker=tracker)
    if not settings.compare:
        return Compressed(searched, {}, [])
    compared, rows = run_comparison(raw, searched.report.as_json(), settings.compare, run, evaluate)
    if out is not None:
        from slimkit.engine.output_safety import write_run_marker
        from slimkit.recipes.compress import write_comparison

        write_comparison(out, rows)
        write_run_marker(out)
    return Compressed(searched, compared, rows)


def evaluate(
    model,
    tokenizer,
    perplexity: Sequence[str] | None = ("wikitext2",),
    zeroshot: Sequence[str] | None = None,
    limit: int | None = None,
    glue: str | None = None,
    speed: bool = False,
    seq_len: int = PERPLEXITY_SEQ_LEN,
    max_tokens: int | None = PERPLEXITY_MAX_TOKENS,
) -> dict[str, float]:
    """Metrics of a model in memory, as ``slimkit eval`` prints them (``wikitext2_ppl``, ``piqa_acc``, ...).

    ``perplexity`` and ``zeroshot`` are lists of names (a bare string is refused); a model with a NaN or inf weight
    is refused in one line naming it."""
    from slimkit.primitives.evaluate.eval_settings import eval_options
    from slimkit.primitives.evaluate.run import check_lm_head, evaluate_model, preflight_eval_data
    from slimkit.primitives.io.finite import check_finite_weights
    from slimkit.primitives.io.paths import as_names

    perplexity, zeroshot = as_names(perplexity, "perplexity"), as_names(zeroshot, "zeroshot")
    eval_config = eval_options("evaluate", perplexity, zeroshot, limit, glue, speed, seq_len, max_tokens)
    preflight_eval_data(eval_config)
    check_lm_head(eval_config, model)
    check_finite_weights(model, "the model given")
    return evaluate_model(model, tokenizer, eval_config).metrics


def __getattr__(name: str):
    # Lazy: `import slimkit` stays cheap (no torch/transformers import) until the API is used.
    if name == "Recipe":
        from slimkit.recipes.schema import Recipe

        return Recipe
    if name == "Result":
        from slimkit.engine.run_result import Result

        return Result
    if name in ("load", "save"):
        from slimkit.primitives import io

        return getattr(io, name)
    if name == "load_source":
        from slimkit.primitives.io.model_sources import load_source

        return load_source
    if name == "export":
        from slimkit.primitives.export import export

        return export
    raise AttributeError(f"module 'slimkit' has no attribute {name!r}")
