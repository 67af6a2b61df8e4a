"""The ``slimkit`` command line (Typer): ``recipe list|show|validate|run``, ``stage list|show``, ``compress``, ``eval``,
``inspect``, ``export``. Input and usage problems print one line, ``error: ...``, and exit with 2.

Method note: docs/methods/engine.md.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import typer

from slimkit.primitives.errors import SlimkitError, closest, did_you_mean, unknown
from slimkit.primitives.evaluate.eval_settings import PERPLEXITY_MAX_TOKENS, PERPLEXITY_SEQ_LEN

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Structured compression of transformer LMs.")
recipe_app = typer.Typer(no_args_is_help=True, help="List, show, validate and run recipes.")
app.add_typer(recipe_app, name="recipe")
stage_app = typer.Typer(no_args_is_help=True, help="The stage catalogue: what each stage does and its arguments.")
app.add_typer(stage_app, name="stage")

SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override a recipe field: dotted.path=value (repeatable).")
]
DeviceOption = Annotated[str | None, typer.Option("--device", help="auto (CUDA when available), cpu, cuda, cuda:N.")]
DtypeOption = Annotated[
    str | None, typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.")
]
MaxMemoryOption = Annotated[
    str | None,
    typer.Option("--max-memory", help="Weights' budget on the device (e.g. 20GiB); the rest is offloaded."),
]


def _console():
    from rich.console import Console

    return Console()


def _split_csv(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


@recipe_app.command("list")
def recipe_list() -> None:
    """List the bundled recipes."""
    from rich.table import Table

    from slimkit.recipes.loading import bundled_recipes, load_recipe

    table = Table("recipe", "target", "description")
    for name in sorted(bundled_recipes()):
        recipe, _ = load_recipe(name)
        table.add_row(name, f"{recipe.target.ratio:g} of {recipe.target.of}", recipe.description)
    _console().print(table)


@recipe_app.command("show")
def recipe_show(name: str) -> None:
    """Print a recipe's YAML."""
    from slimkit.recipes.loading import read_recipe_text, recipe_path

    typer.echo(read_recipe_text(recipe_path(name)), nl=False)


@recipe_app.command("validate")
def recipe_validate(file: str, overrides: SetOption = None) -> None:
    """Check a recipe file (or bundled name) against the schema and the stage registry."""
    from slimkit.recipes.loading import load_recipe

    recipe, _ = load_recipe(file, overrides)
    stages = ", ".join(s.stage for s in recipe.flat_stages())
    typer.echo(f"ok: {recipe.name} ({recipe.target.ratio:g} of {recipe.target.of}; stages: {stages})")


@recipe_app.command("run")
def recipe_run(
    recipe: Annotated[str, typer.Argument(help="Bundled recipe name or path to a recipe YAML.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    model: Annotated[str | None, typer.Option("--model", help="Model source or local folder.")] = None,
    overrides: SetOption = None,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the recipe's evaluations.")] = False,
    dense: Annotated[
        bool,
        typer.Option(
            "--dense/--no-dense",
            help="Put the dense model's metrics (same settings; measured once, then cached) beside the run's.",
        ),
    ] = True,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an earlier slimkit output (or an empty folder) at --out.")
    ] = False,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    max_memory: MaxMemoryOption = None,
    save_dtype: Annotated[
        str | None, typer.Option("--save-dtype", help="Dtype of the saved weights (default: the model's dtype).")
    ] = None,
) -> None:
    """Compress a model with a recipe; writes OUT/model, OUT/report.json and OUT/report.md."""
    import slimkit
    from slimkit.engine.processes import join_processes
    from slimkit.engine.progress import RichTracker
    from slimkit.engine.report_files import markdown
    from slimkit.primitives.io.describe import saved_structure
    from slimkit.recipes.loading import load_recipe

    all_overrides = list(overrides or [])
    settings = {"source": model, "device": device, "dtype": dtype, "max_memory": max_memory, "save_dtype": save_dtype}
    all_overrides += [f"model.{key}={value}" for key, value in settings.items() if value is not None]
    parsed, _raw = load_recipe(recipe, all_overrides)
    result = slimkit.run(parsed, out, force=force, evaluate=not no_eval, compare_dense=dense, tracker=RichTracker())
    if join_processes().main:  # under torchrun / accelerate launch, the main process writes and reports
        typer.echo(markdown(result.report, "widths.png", saved_structure(out / "model")))


@app.command("compress")
def compress_command(
    model: Annotated[str, typer.Argument(help="Model source name or folder (e.g. smollm2-135m).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    params: Annotated[
        float | None, typer.Option("--params", help="Fraction of the parameters kept (0.8: remove 20%).")
    ] = None,
    memory: Annotated[
        str | None, typer.Option("--memory", help="Most memory at --context x --batch: weights + KV cache (2GiB).")
    ] = None,
    context: Annotated[int, typer.Option("--context", help="Tokens per sequence for --memory.")] = 4096,
    batch: Annotated[int, typer.Option("--batch", help="Sequences at once for --memory.")] = 1,
    speedup: Annotated[
        float | None, typer.Option("--speedup", help="Times faster than dense in --runtime (prefill and decode).")
    ] = None,
    runtime: Annotated[str, typer.Option("--runtime", help="Where it will be served: llama.cpp or pytorch.")] = (
        "llama.cpp"
    ),
    uniform: Annotated[
        str | None,
        typer.Option("--uniform", help="Sub-blocks replaced alike in every layer (attention,mlp): one width for all."),
    ] = None,
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="Seconds for the search.")] = None,
    compare: Annotated[
        str | None, typer.Option("--compare", help="Bundled recipes to run at the same budget (quality,deploy).")
    ] = None,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the evaluation.")] = False,
    dense: Annotated[
        bool, typer.Option("--dense/--no-dense", help="Put the dense model's metrics beside the run's.")
    ] = True,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an earlier slimkit output (or an empty folder) at --out.")
    ] = False,
) -> None:
    """Find the best model under a budget (the search stage) and write it, its recipe (OUT/search/recipe.yaml: no
    search when rerun) and its report (OUT/search/scores.png: the candidates' scores per layer)."""
    import slimkit
    from slimkit.engine.progress import RichTracker
    from slimkit.engine.report_files import markdown
    from slimkit.primitives.io.describe import saved_structure
    from slimkit.recipes.compress import comparison_markdown

    if runtime not in ("llama.cpp", "pytorch"):
        raise SlimkitError(unknown("--runtime", runtime, ["llama.cpp", "pytorch"]))
    if runtime != "llama.cpp" and speedup is None:
        raise SlimkitError("--runtime says where --speedup is measured; give --speedup too")
    result = slimkit.compress(
        model,
        out,
        params=params,
        memory=memory,
        context=context,
        batch=batch,
        speedup=speedup,
        runtime=runtime,
        uniform=_split_csv(uniform),
        time_limit=time_limit,
        compare=_split_csv(compare),
        force=force,
        evaluate=not no_eval,
        compare_dense=dense,
        tracker=RichTracker(),
    )
    typer.echo(markdown(result.search.report, "widths.png", saved_structure(out / "model")))
    if result.rows:
        typer.echo(comparison_markdown(result.rows))


SCOPES = {
    "layer": "layer: runs once per layer (may sit inside `sequential`)",
    "model": "model: runs once on the whole model",
}


def _type_name(annotation: Any) -> str:
    """A field's type as a recipe writer reads it: ``Literal['a', 'b']`` is ``a | b``, ``int | None`` stays."""
    if annotation is None or annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(str(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(arg) for arg in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _constraints(field: Any) -> list[str]:
    """The field's bounds (``ge``, ``gt``, ``le``, ``lt``, ``min_length``) as ``>= 0``, ``< 1``, ..."""
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    out = []
    for item in field.metadata:
        for attribute, symbol in symbols.items():
            value = getattr(item, attribute, None)
            if value is not None:
                out.append(f"{symbol} {value:g}" if isinstance(value, float) else f"{symbol} {value}")
        if getattr(item, "min_length", None):
            out.append(f"at least {item.min_length} item{'s' if item.min_length > 1 else ''}")
    return out


def _default_text(field: Any) -> str:
    """The default as it is written in a recipe (YAML: ``null``, ``true``, ``[mlp_channel]``)."""
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "computed"
    else:
        value = field.default
    return value if isinstance(value, str) else json.dumps(value).replace('"', "")


def _describe(text: str | None) -> str:
    return " ".join((text or "").split())


def _calibration_text(definition: Any) -> str:
    """Whether the stage reads calibration data: ``yes``/``no`` when its arguments class declares that the answer
    depends on none of them (``calibration_depends_on``), else the answer with the default arguments and the values
    of those arguments (a choice or a flag) that change it."""
    from pydantic import ValidationError

    from slimkit.recipes.stage_args import ReadsData, offered

    try:
        defaults = definition.args()
    except ValidationError:  # required arguments: no defaults to ask about
        return "depends on the arguments"
    needs = offered(defaults, ReadsData).needs_calibration()
    if not (issubclass(definition.args, ReadsData) and definition.args.calibration_depends_on):
        return "yes" if needs else "no"  # declared: the answer is the same for every value
    other: list[str] = []
    for name in definition.args.calibration_depends_on:
        annotation = definition.args.model_fields[name].annotation
        values: tuple[Any, ...] = ()
        if annotation is bool:
            values = (not getattr(defaults, name),)
        elif typing.get_origin(annotation) is typing.Literal:
            values = tuple(v for v in typing.get_args(annotation) if v != getattr(defaults, name))
        for value in values:
            try:
                changed = definition.args.model_validate({name: value})
            except ValidationError:  # a value the other arguments' defaults rule out
                continue
            if offered(changed, ReadsData).needs_calibration() != needs:
                other.append(f"{name}: {json.dumps(value).replace(chr(34), '')}")
    answer = f"{'yes' if needs else 'no'} with the default arguments"
    if not other:
        return f"{answer} (it depends on them)"
    return f"{answer}; {'no' if needs else 'yes'} with {', '.join(other)}"


def _strip_roles(text: str) -> str:
    # Sphinx cross-references (:func:`x`, :mod:`~x`) read as the code they name.
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"``\1``", text)


def _reflow(text: str) -> list[str]:
    """A docstring's paragraphs and list items, each joined into one line (the terminal wraps them);
    indented blocks (equations, code) keep their lines."""
    blocks: list[str] = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.splitlines()
        if lines and lines[0].startswith("    "):
            blocks.append(paragraph)
            continue
        items: list[list[str]] = []
        for line in lines:
            if not items or re.match(r"(\*|-|\d+\.) ", line):
                items.append([line.strip() if items else line])
            else:
                items[-1].append(line.strip())
        blocks.append("\n".join(" ".join(item) for item in items))
    return blocks


def _stage_doc(definition: Any) -> str:
    """The stage class's docstring after its summary when it says more, else its module's docstring
    without the paragraphs that start by naming another stage of that module."""
    kind = type(definition.stage)
    own = inspect.getdoc(kind) or ""
    body = "\n".join(own.splitlines()[1:]).strip()  # the first line is the summary, printed above
    if body:
        return _strip_roles(body)
    from slimkit.recipes.catalogue import STAGES

    module = inspect.getmodule(kind)
    text = inspect.getdoc(module) or own
    siblings = [
        d.name for d in STAGES.values() if d.name != definition.name and type(d.stage).__module__ == kind.__module__
    ]
    paragraphs = [
        paragraph
        for paragraph in text.split("\n\n")
        if not any(paragraph.lstrip("(* ").startswith(f"``{other}``") for other in siblings)
    ]
    return _strip_roles("\n\n".join(paragraphs))


@stage_app.command("list")
def stage_list() -> None:
    """List the registered stages: name, scope, what each does and where it comes from (slimkit, or an installed
    package's ``slimkit.stages`` entry point); a plugin that failed to load is listed with why."""
    from rich.table import Table
    from rich.text import Text

    from slimkit.recipes.catalogue import BROKEN, BUILT_IN, stage_def, stage_names

    table = Table("stage", "scope", "summary", "from")
    for name in stage_names():
        definition = stage_def(name)
        origin = "slimkit" if definition.origin == BUILT_IN else definition.origin
        table.add_row(name, definition.scope, Text(definition.summary), Text(origin))
    console = _console()
    console.print(table)
    for broken in BROKEN.values():
        console.print(Text(f"not loaded: {broken.refusal()}"))


@stage_app.command("support")
def stage_support() -> None:
    """What each stage does on each decoder architecture: works, or refused and why (markdown, generated from the
    code; docs/methods/architectures.md holds the same)."""
    from slimkit.engine.support_table import support_markdown

    typer.echo(support_markdown())


@stage_app.command("show")
def stage_show(name: Annotated[str, typer.Argument(help="A registered stage (see `slimkit stage list`).")]) -> None:
    """Describe a stage: what it does, its scope, whether it needs calibration data, every argument."""
    from rich.table import Table
    from rich.text import Text

    from slimkit.recipes.catalogue import stage_def, stage_names
    from slimkit.recipes.stage_args import ReadsData, offered

    try:
        definition = stage_def(name)
    except KeyError:
        raise SlimkitError(unknown("stage", name, stage_names())) from None
    console = _console()
    console.print(Text(f"{definition.name}: {definition.summary}", style="bold"))
    facts = [
        ("scope", SCOPES.get(definition.scope, definition.scope)),
        ("from", definition.origin),
        ("calibration data", _calibration_text(definition)),
    ]
    if offered(definition.args.model_construct(), ReadsData).needs_task():  # the answer does not depend on values
        facts.append(("task", "needs the recipe's task (a GLUE task model)"))
    if definition.trains:
        facts.append(("dtype", "trains through the model: float32 or bfloat16 weights (float16 is refused)"))
    if definition.scope == "model":
        facts.append(("memory", "the whole model on the device (not with model.max_memory offloading)"))
    paper = getattr(definition, "paper", None)
    if paper:
        facts.append(("paper", str(paper)))
    for label, value in facts:
        console.print(Text(f"{label}: {value}"))
    for block in _reflow(_stage_doc(definition)):
        console.print()
        console.print(Text(block))
    console.print()
    # Four columns on a wide terminal; on a narrow one type and default go under the name, so the
    # description keeps a readable width.
    wide = console.width >= 110
    table = Table(title=f"{definition.name} arguments", title_justify="left", expand=True, show_lines=not wide)
    table.add_column("argument", no_wrap=True, max_width=None if wide else 30)
    if wide:
        table.add_column("type", max_width=28)
        table.add_column("default", max_width=16)
    table.add_column("description", ratio=1)
    for arg, field in definition.args.model_fields.items():
        kind = ", ".join([_type_name(field.annotation), *_constraints(field)])
        default = _default_text(field)
        description = Text(_describe(field.description))
        if wide:
            table.add_row(arg, Text(kind), Text(default), description)
        else:
            cell = Text(arg, style="bold")
            cell.append(f"\n{kind}\ndefault: {default}", style="")
            table.add_row(cell, description)
    console.print(table)
    console.print(Text("Values are YAML: None is written null, True and False true and false."))


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Argument(help="Model source name or folder (e.g. smollm2-135m, runs/x/model).")],
    ppl: Annotated[
        str | None,
        typer.Option("--ppl", help="Comma-separated perplexity datasets (default wikitext2, none with --glue)."),
    ] = None,
    zeroshot: Annotated[str | None, typer.Option("--zeroshot", help="Comma-separated zero-shot tasks.")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Samples per zero-shot task / GLUE dev set.")] = None,
    glue: Annotated[
        str | None, typer.Option("--glue", help="GLUE task (sst2, mrpc, rte, stsb): dev-set metrics of a task model.")
    ] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Perplexity window length.")] = PERPLEXITY_SEQ_LEN,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="Perplexity token budget (0 = whole test set).")
    ] = PERPLEXITY_MAX_TOKENS,
    speed: Annotated[bool, typer.Option("--speed", help="Also measure prefill/decode tokens per second.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    max_memory: MaxMemoryOption = None,
) -> None:
    """Evaluate a model: perplexity, zero-shot accuracy through lm-eval, GLUE dev metrics, throughput. Any causal
    LM transformers builds with its own classes, whether or not a recipe can compress it."""
    from rich.table import Table

    from slimkit.engine.progress import RichTracker
    from slimkit.primitives.evaluate.counting import count_params
    from slimkit.primitives.evaluate.eval_settings import eval_options
    from slimkit.primitives.evaluate.run import (
        check_eval_length,
        check_lm_evaluations,
        check_lm_head,
        evaluate_model,
        preflight_eval_data,
    )
    from slimkit.primitives.files.guard import check_file_target, check_not_input, write_text_file
    from slimkit.primitives.io.finite import check_finite_weights
    from slimkit.primitives.io.folder import check_tokenizer_files
    from slimkit.primitives.io.model_sources import check_source, load_source

    if json_out is not None:
        check_file_target("--json", json_out)
    if ppl is None:
        ppl = "" if glue else "wikitext2"
    eval_config = eval_options(
        "slimkit eval", _split_csv(ppl), _split_csv(zeroshot), limit, glue, speed, seq_len, max_tokens or None
    )
    # The folder is checked (config, custom code, weight headers) and its task known before any data is read; any
    # causal LM transformers builds with its own classes is evaluated, with or without compression support.
    folder, source = check_source(model, purpose="evaluate")
    if json_out is not None:
        check_not_input("--json", json_out, [folder])
    if source.task == "encoder":
        remedy = "evaluate it on a GLUE task with --glue TASK (sst2, mrpc, rte, stsb)"
        check_lm_evaluations(eval_config, model, remedy)
    check_tokenizer_files(folder, "evaluation")
    preflight_eval_data(eval_config)
    loaded, tokenizer, info = load_source(
        model, device=device or "auto", dtype=dtype or "auto", max_memory=max_memory, purpose="evaluate"
    )
    check_eval_length(eval_config, loaded)
    check_lm_head(eval_config, loaded, f"model {model}")
    check_finite_weights(loaded, f"model {model}")
    evaluation = evaluate_model(loaded, tokenizer, eval_config, RichTracker())
    metrics, details = evaluation.metrics, evaluation.details
    table = Table("metric", "value")
    table.add_row("parameters", f"{count_params(loaded):,}")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}")
    for item in details.get("perplexity", []):
        table.add_row(
            f"{item['dataset']} windows", f"{item['windows']} x {item['seq_len']} = {item['tokens']:,} tokens"
        )
    if "glue" in details:
        table.add_row("glue dev examples", f"{details['glue']['task']}: {details['glue']['examples']}")
    if "speed" in details:
        table.add_row("prefill tokens/s", f"{details['speed']['prefill_tokens_per_s']:.1f}")
        table.add_row("decode tokens/s", f"{details['speed']['decode_tokens_per_s']:.1f}")
    _console().print(table)
    for note in evaluation.notes:
        _console().print(f"note: {note}")
    if json_out is not None:
        text = json.dumps({"model": info.name, "metrics": metrics, "details": details}, indent=2) + "\n"
        write_text_file(json_out, text, "--json")


@app.command("export")
def export_command(
    model: Annotated[str, typer.Argument(help="Model source name or folder (e.g. runs/x/model).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output GGUF file (gguf) or folder (hf).")],
    format: Annotated[
        str, typer.Option("--format", help="gguf (llama.cpp) or hf (plain Hugging Face folder).")
    ] = "gguf",
    type: Annotated[
        str | None, typer.Option("--type", help="GGUF weight type: f32, f16 (default), bf16, q8_0.")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing GGUF file / model folder at --out (nothing else).")
    ] = False,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="hf: load the folder back with stock transformers and compare.")
    ] = True,
) -> None:
    """Export a model for inference engines: GGUF for llama.cpp (per-layer widths via its deci architecture)
    or a plain Hugging Face folder; low-rank pairs are merged into dense weights."""
    from slimkit.primitives.export import export, result_lines

    result = export(model, out, format, type, force=force, verify=verify)
    for line in result_lines(result.as_dict()):
        typer.echo(line)


@app.command("inspect")
def inspect_command(model: Annotated[str, typer.Argument(help="Model source name or folder.")]) -> None:
    """Per-layer widths, low-rank ranks, residual maps and parameter counts; which loaders read the folder; for a
    causal LM no recipe compresses, the widths its config names and why it cannot be compressed."""
    from slimkit.primitives.io.describe import describe_source

    console = _console()
    for item in describe_source(model).renderables():
        console.print(item)


def _click_exceptions() -> types.ModuleType:
    """The exceptions module of the click typer runs on: its bundled copy where it has one, else click."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions  # type: ignore[no-redef]  # the same module, where typer bundles none
    return exceptions


def _param_label(param: Any) -> str:
    """``--out`` for an option (its long name), ``RECIPE`` for an argument."""
    if param.param_type_name == "option":
        return next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])
    return getattr(param, "metavar", None) or (param.name or "").upper()


def _usage_message(error: Any) -> str:
    """A click usage error as one line that names what is wrong and the command it is wrong for."""
    try:
        return _describe_usage_error(error)
    except Exception:  # a click internals change must not turn a usage error into a traceback
        return " ".join(error.format_message().split())


def _describe_usage_error(error: Any) -> str:
    exceptions = _click_exceptions()
    ctx = getattr(error, "ctx", None)
    command = f" for '{ctx.command_path}'" if ctx is not None else ""
    if isinstance(error, exceptions.NoSuchOption):
        options: dict[str, str] = {}
        if ctx is not None:
            for param in ctx.command.get_params(ctx):
                if param.param_type_name == "option":
                    options.update({opt.lstrip("-"): opt for opt in (*param.opts, *param.secondary_opts)})
        # Compared without the dashes, which every option shares.
        match = closest(error.option_name.lstrip("-"), options)
        hint = f"; did you mean '{options[match]}'?" if match else ""
        return f"no such option '{error.option_name}'{command}{hint}"
    param = getattr(error, "param", None)
    if isinstance(error, exceptions.MissingParameter) and param is not None:
        return f"missing {param.param_type_name} '{_param_label(param)}'{command}"
    if isinstance(error, exceptions.BadParameter) and param is not None:
        where = f" of '{ctx.command_path}'" if ctx is not None else ""
        message = " ".join(str(error.message).split())
        return f"invalid value for {param.param_type_name} '{_param_label(param)}'{where}: {message}"
    unknown_command = re.match(r"No such command '(.*?)'", error.message)
    if unknown_command and ctx is not None and hasattr(ctx.command, "list_commands"):
        name, commands = unknown_command.group(1), ctx.command.list_commands(ctx)
        hint = did_you_mean(name, commands)
        return f"no such command '{name}'" + (hint or f"; commands of '{ctx.command_path}': {', '.join(commands)}")
    message = " ".join(error.format_message().split()).rstrip(".")
    return f"{message[:1].lower()}{message[1:]}{command}"


OUT_OF_MEMORY = (
    "slimkit ran out of host memory (the machine's, or the process's limit: ulimit -v); free memory, raise the "
    "limit or use a smaller model or fewer tokens"
)
"""The line printed for a MemoryError no step translated (made before it is needed: printing must not allocate much)."""


def _out_of_memory() -> typing.NoReturn:
    """Print :data:`OUT_OF_MEMORY` and exit 2 at once: exit handlers (torch's among them) would fail again for want of
    memory and print their own tracebacks. The command's own clean-up already ran as the error left it."""
    print(f"error: {OUT_OF_MEMORY}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(2)


def main() -> None:
    """Entry point: runs the Typer app, turning input and usage errors into one line and exit status 2."""
    exceptions = _click_exceptions()
    no_args_is_help = getattr(exceptions, "NoArgsIsHelpError", ())
    try:
        # Without standalone mode Typer returns the exit code of an interrupted command (130).
        code = app(prog_name="slimkit", standalone_mode=False)
    except SlimkitError as error:
        if getattr(error, "shown", True):  # launched processes refusing together: the main one says it
            print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except MemoryError:  # outside the steps that name themselves (a run's load, stages, save, export)
        _out_of_memory()
    except OSError as error:  # the kernel refusing memory to a system call (a thread, a mapping)
        if error.errno != errno.ENOMEM:
            raise
        _out_of_memory()
    except no_args_is_help as error:
        # A group called without a command: its help (rich help is already printed by now). Status 2.
        text = error.format_message().strip()
        if text:
            print(text, file=sys.stderr)
        sys.exit(2)
    except exceptions.UsageError as error:
        print(f"error: {_usage_message(error)}", file=sys.stderr)
        sys.exit(2)
    except exceptions.ClickException as error:
        print(f"error: {' '.join(error.format_message().split())}", file=sys.stderr)
        sys.exit(error.exit_code)
    except typer.Exit as error:  # typer's own (its bundled click has none); click's with older typer
        sys.exit(error.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    if isinstance(code, int) and code != 0:
        if code == 130:
            print("interrupted", file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
