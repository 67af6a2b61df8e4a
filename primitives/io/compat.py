"""Which loaders can read a saved folder, and the config mark that keeps stock loaders out.

A folder stock transformers would build differently (low-rank pairs, residual matrices, per-layer widths) has its
``config.json`` marked ``slimkit_compressed``, so stock loaders refuse it instead of misreading it.

Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from slimkit.primitives.errors import SlimkitError

SLIMKIT_MODEL_TYPE = "slimkit_compressed"
"""``model_type`` of a slimkit-only folder: unknown to transformers' ``AutoConfig``."""
SLIMKIT_ARCHITECTURE = "SlimkitCompressedModel"
"""``architectures`` entry of a slimkit-only folder (not a transformers class)."""
BASE_MODEL_TYPE_KEY = "slimkit_base_model_type"
BASE_ARCHITECTURES_KEY = "slimkit_base_architectures"
NOTE_KEY = "slimkit_note"
MARK_KEYS = (BASE_MODEL_TYPE_KEY, BASE_ARCHITECTURES_KEY, NOTE_KEY)

_KIND_WORDS = {
    "low_rank": "low-rank pair",
    "basis_change": "residual / basis-change map",
    "rms_norm": "LayerNorm converted to RMSNorm",
}


def structure_reasons(per_layer: dict[str, Any] | None, modules: list[dict[str, Any]] | None) -> list[str]:
    """Why stock transformers cannot build the model exactly (empty: it can), in words."""
    reasons = []
    for kind, count in Counter(entry.get("kind", "?") for entry in modules or []).items():
        word = _KIND_WORDS.get(kind, f"'{kind}' module")
        reasons.append(f"{count} {word}{'' if count == 1 else 's'}")
    if per_layer:
        keys = sorted({key for widths in per_layer.values() for key in widths})
        varying = [k for k in keys if len({str(widths.get(k)) for widths in per_layer.values()}) > 1]
        detail = f" ({', '.join(varying)} vary)" if varying else ""
        reasons.append(f"per-layer widths in per_layer_config{detail}")
    return reasons


def is_marked(config: dict[str, Any]) -> bool:
    return config.get("model_type") == SLIMKIT_MODEL_TYPE


def mark_config(config: dict[str, Any], reasons: list[str]) -> dict[str, Any]:
    """``config`` (a config.json dict) with the slimkit mark; the original type and architectures kept."""
    if is_marked(config):
        return dict(config)
    marked = dict(config)
    marked[BASE_MODEL_TYPE_KEY] = config["model_type"]
    marked[BASE_ARCHITECTURES_KEY] = config.get("architectures")
    marked["model_type"] = SLIMKIT_MODEL_TYPE
    marked["architectures"] = [SLIMKIT_ARCHITECTURE]
    marked[NOTE_KEY] = (
        f"A {config['model_type']} model compressed by slimkit with {'; '.join(reasons)}. Stock transformers "
        "cannot build it exactly; load it with slimkit.load(folder) (see slimkit_manifest.json)."
    )
    return marked


def unmark_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the original ``model_type`` / ``architectures`` restored and the mark removed."""
    plain = {k: v for k, v in config.items() if k not in MARK_KEYS}
    if is_marked(config):
        if not config.get(BASE_MODEL_TYPE_KEY):
            raise SlimkitError(f"config.json has model_type {SLIMKIT_MODEL_TYPE!r} but no {BASE_MODEL_TYPE_KEY}")
        plain["model_type"] = config[BASE_MODEL_TYPE_KEY]
        architectures = config.get(BASE_ARCHITECTURES_KEY)
        if architectures:
            plain["architectures"] = architectures
        else:
            plain.pop("architectures", None)
    return plain


__all__ = [
    "BASE_ARCHITECTURES_KEY",
    "BASE_MODEL_TYPE_KEY",
    "NOTE_KEY",
    "SLIMKIT_ARCHITECTURE",
    "SLIMKIT_MODEL_TYPE",
    "is_marked",
    "mark_config",
    "structure_reasons",
    "unmark_config",
]
