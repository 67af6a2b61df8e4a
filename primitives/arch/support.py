"""Which architectures slimkit supports, and the one-line refusal for the others: :func:`check_supported` per task
(``causal-lm`` decoders, ``encoder`` BERT), :func:`check_no_custom_code` (slimkit never runs a repository's code) and
:func:`check_evaluable` (evaluation and inspection take any built-in transformers causal LM).

Method note: docs/methods/architectures.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slimkit.primitives.arch.spec import ARCH_SPECS
from slimkit.primitives.errors import SlimkitError

SUPPORTED: dict[str, tuple[str, ...]] = {
    "causal-lm": tuple(sorted(t for t, spec in ARCH_SPECS.items() if not spec.encoder)),
    "encoder": tuple(sorted(t for t, spec in ARCH_SPECS.items() if spec.encoder)),
}
"""Supported ``model_type`` s per task (decoders and encoders, by :attr:`ArchSpec.encoder`)."""


VISION_LANGUAGE_TYPES: dict[str, str] = {"gemma3": "gemma3_text"}
"""Vision-language ``model_type`` s whose language model slimkit compresses (the vision tower and projector kept), and
the language model's type, which the support checks read (:mod:`slimkit.primitives.io.vision_language`)."""

NOT_YET: dict[str, str] = {}
"""Decoders transformers runs that slimkit does not compress yet, and the architectural reason (in the refusal)."""

_CODE_FREE_AUTO = ("AutoTokenizer", "AutoProcessor", "AutoImageProcessor", "AutoFeatureExtractor")
"""``auto_map`` entries that do not replace the model's code (a custom tokenizer or processor class)."""


def _field(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _model_type(config: Any) -> str | None:
    model_type = _field(config, "model_type")
    from slimkit.primitives.io.compat import BASE_MODEL_TYPE_KEY, SLIMKIT_MODEL_TYPE  # io imports arch

    if model_type == SLIMKIT_MODEL_TYPE:
        model_type = _field(config, BASE_MODEL_TYPE_KEY)
    return VISION_LANGUAGE_TYPES.get(model_type, model_type) if isinstance(model_type, str) else model_type


def _supported_for(task: str | None) -> tuple[str, ...]:
    if task is None:
        return tuple(sorted(ARCH_SPECS))
    if task not in SUPPORTED:
        raise SlimkitError(f"unknown model task '{task}'; allowed: {', '.join(SUPPORTED)}")
    return SUPPORTED[task]


def task_of(config: Any) -> str:
    """``"encoder"`` for an encoder architecture (BERT), else ``"causal-lm"`` (a local folder's task)."""
    return "encoder" if _model_type(config) in SUPPORTED["encoder"] else "causal-lm"


def unsupported_message(model_type: str | None, task: str | None = None) -> str:
    """``"model_type 'gpt2' is not supported for causal-lm recipes; supported: llama, ..."`` (one line).

    Without ``task`` every architecture slimkit has an adapter for is listed.
    """
    supported = _supported_for(task)
    what = f"model_type '{model_type}'" if model_type else "a config without a model_type"
    scope = f" for {task} recipes" if task else ""
    reason = f" ({NOT_YET[model_type]})" if model_type in NOT_YET else ""
    return f"{what} is not supported{scope}{reason}; supported: {', '.join(supported)}"


def _check_code_free(config: Any, allowed: str) -> None:
    """Refuse a config whose ``auto_map`` maps a config or model class; ``allowed`` ends the line."""
    auto_map = _field(config, "auto_map")
    names = sorted(auto_map) if isinstance(auto_map, Mapping) else ([str(auto_map)] if auto_map else [])
    names = [name for name in names if not name.startswith(_CODE_FREE_AUTO)]
    if names:
        raise SlimkitError(
            f"model_type '{_model_type(config)}' needs custom code (auto_map: {', '.join(names)}), which slimkit "
            f"never runs (no trust_remote_code); {allowed}"
        )


def check_supported(config: Any, task: str = "causal-lm") -> None:
    """Raise :class:`SlimkitError` (one line) unless ``config`` is an architecture ``task`` supports.

    Custom-code configs (``auto_map``) are refused first, naming the classes they map and the
    supported built-in architectures.
    """
    supported = _supported_for(task)
    _check_code_free(config, f"supported built-in architectures for {task} recipes: {', '.join(supported)}")
    if _model_type(config) not in supported:
        raise SlimkitError(unsupported_message(_model_type(config), task))


def builtin_causal_lm(model_type: str | None) -> bool:
    """Whether transformers builds ``model_type`` as a causal language model with its own classes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return bool(model_type) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def check_evaluable(config: Any, task: str | None = None) -> str:
    """The task to evaluate ``config``'s model as (``causal-lm`` or ``encoder``); one :class:`SlimkitError` line
    unless slimkit has an adapter for it or transformers builds it as a causal LM with its own classes.

    Custom code is refused as by :func:`check_supported`. ``task``: the task a named source declares (an encoder
    needs its adapter: slimkit evaluates encoders on GLUE through it).
    """
    model_type = _model_type(config)
    _check_code_free(config, "slimkit evaluates built-in transformers architectures only")
    task = task or task_of(config)
    if task == "encoder" or model_type in SUPPORTED["causal-lm"]:
        check_supported(config, task)
        return task
    if not builtin_causal_lm(model_type):
        what = f"model_type '{model_type}'" if model_type else "a config without a model_type"
        raise SlimkitError(
            f"{what} is not a causal language model transformers builds (AutoModelForCausalLM has no class for it) "
            f"and not an architecture slimkit compresses ({', '.join(sorted(ARCH_SPECS))}); slimkit evaluates "
            "causal LMs and its supported encoders"
        )
    return "causal-lm"


def compression_support(config: Any, task: str = "causal-lm") -> str | None:
    """Why no compression recipe runs on ``config``'s model (the one line :func:`check_supported` gives), or None
    when slimkit has an adapter for it."""
    try:
        check_supported(config, task)
    except SlimkitError as error:
        return str(error)
    return None


CODE_CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
"""The JSON files of a model folder whose ``auto_map`` makes transformers import the folder's own code."""


def _auto_map_entries(auto_map: Any) -> list[str]:
    """``["AutoTokenizer -> tokenization_x.XTokenizer", ...]`` for an ``auto_map`` value."""
    if isinstance(auto_map, Mapping):
        entries = []
        for key, value in auto_map.items():
            targets = [str(v) for v in value if v] if isinstance(value, list | tuple) else [str(value)]
            entries.append(f"{key} -> {', '.join(targets)}" if targets else str(key))
        return entries
    return [str(auto_map)] if auto_map else []


def check_no_custom_code(directory: str | Path, config: Mapping[str, Any] | None = None) -> None:
    """Refuse (one line) a model folder that would need its own code: an ``auto_map`` in
    ``config.json`` / ``tokenizer_config.json`` (any class, tokenizers included) or a ``*.py`` file.

    ``config``: ``config.json`` already read (it is read here otherwise). Call it before any
    transformers loader sees the folder; slimkit never passes ``trust_remote_code=True``.
    """
    directory = Path(directory)
    never = "which slimkit never runs (it loads built-in transformers classes only, trust_remote_code=False)"
    for name in CODE_CONFIG_FILES:
        path = directory / name
        if name == "config.json" and config is not None:
            data: Any = config
        elif path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                raise SlimkitError(f"{path}: not valid JSON ({error})") from None
        else:
            continue
        entries = _auto_map_entries(data.get("auto_map")) if isinstance(data, Mapping) else []
        if entries:
            raise SlimkitError(f"{path}: auto_map names the folder's own code ({'; '.join(entries)}), {never}")
    code = sorted(p.name for p in directory.glob("*.py"))
    if code:
        raise SlimkitError(
            f"model folder {directory} holds Python code ({', '.join(code[:5])}), {never}; "
            "remove the .py files if the folder is a built-in architecture"
        )


__all__ = [
    "CODE_CONFIG_FILES",
    "NOT_YET",
    "SUPPORTED",
    "VISION_LANGUAGE_TYPES",
    "builtin_causal_lm",
    "check_evaluable",
    "check_no_custom_code",
    "check_supported",
    "compression_support",
    "task_of",
    "unsupported_message",
]
