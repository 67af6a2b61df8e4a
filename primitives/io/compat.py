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
    "head_widths": "attention with per-head widths",
}


def removed_block_layers(per_layer: dict[str, Any] | None) -> dict[str, list[int]]:
    """The layers whose attention or MLP block ``per_layer_config`` records as removed (zero query heads, zero MLP
    width; see :mod:`slimkit.primitives.blocks`), by kind; empty when none."""
    found: dict[str, list[int]] = {}
    for index, widths in per_layer.items() if isinstance(per_layer, dict) else ():
        if not isinstance(widths, dict) or not str(index).isdigit():
            continue  # a malformed entry: the loader's own checks name it
        if widths.get("num_attention_heads") == 0:
            found.setdefault("attention", []).append(int(index))
        if widths.get("intermediate_size") == 0 or widths.get("ffn_dim") == 0:
            found.setdefault("mlp", []).append(int(index))
    return {kind: sorted(layers) for kind, layers in found.items()}


def removed_blocks_phrase(removed: dict[str, list[int]]) -> str:
    """``"attention blocks of layers 3, 7 and the MLP block of layer 12 removed"`` for :func:`removed_block_layers`."""
    parts = []
    for kind, layers in removed.items():
        name = "attention" if kind == "attention" else "MLP"
        plural = len(layers) > 1
        parts.append(
            f"the {name} block{'s' if plural else ''} of layer{'s' if plural else ''} {', '.join(map(str, layers))}"
        )
    return " and ".join(parts) + " removed"


def structure_reasons(per_layer: dict[str, Any] | None, modules: list[dict[str, Any]] | None) -> list[str]:
    """Why stock transformers cannot build the model exactly (empty: it can), in words."""
    reasons = []
    for kind, count in Counter(entry.get("kind", "?") for entry in modules or []).items():
        word = _KIND_WORDS.get(kind, f"'{kind}' module")
        reasons.append(f"{count} {word}{'' if count == 1 else 's'}")
    removed = removed_block_layers(per_layer)
    if removed:
        reasons.append(removed_blocks_phrase(removed))
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
    "removed_block_layers",
    "removed_blocks_phrase",
    "structure_reasons",
    "unmark_config",
]
