"""What a saved folder can be exported as, decided from its config and manifest alone (no model built).

Used by ``slimkit inspect`` and the run report ("readable by"); the export itself decides again on the
loaded model (:mod:`.dense`, :mod:`.gguf_file`, :mod:`.hf_folder`) and the two agree by construction:
the same structures are merged (low-rank pairs; output maps of the embedding or final norm) or refused
(maps on a layer's input or residual, LayerNorms converted to RMSNorm, per-layer hidden sizes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export.gguf_file import (
    PADDED_ARCHITECTURES,
    QUERY_SPANS_HIDDEN,
    gguf_architecture,
    phi3_head_refusal,
    query_width_refusal,
)
from slimkit.primitives.export.hf_folder import HF_MODEL_TYPES, removed_blocks_refusal
from slimkit.primitives.io.compat import removed_block_layers


@dataclass(frozen=True)
class ExportVerdict:
    format: str
    """``gguf llama``, ``gguf deci``, ``hf`` (what the export would write), or the format asked about."""
    ok: bool
    detail: str


def _blocking(modules: Iterable[dict[str, Any]]) -> str | None:
    for entry in modules:
        kind = entry.get("kind")
        if kind == "basis_change" and entry.get("hook") in ("input", "residual", "branch"):
            return (
                f"a residual / basis-change matrix at {entry.get('path')} has no exact merge into a dense decoder "
                "(SP3 with several layer groups)"
            )
        if kind == "rms_norm":
            return "LayerNorms converted to RMSNorm have no dense-decoder equivalent"
        if kind == "head_widths":
            return f"the attention at {entry.get('path')} keeps per-head widths, which no dense format can hold"
    return None


def _merges(modules: list[dict[str, Any]]) -> str:
    lowrank = sum(1 for entry in modules if entry.get("kind") == "low_rank")
    maps = [entry for entry in modules if entry.get("kind") == "basis_change" and entry.get("hook") == "output"]
    parts = []
    if lowrank:
        parts.append(f"{lowrank} low-rank pairs merged into dense weights (a larger file)")
    for entry in maps:
        host = str(entry.get("path", "")).rpartition(".basis_change")[0]
        into = "the embedding table" if host.endswith("embed_tokens") else "the head"
        parts.append(f"the output map of {host} folded into {into} (untied)")
    return "; ".join(parts)


def _head_widths(
    per_layer: dict[str, dict[str, Any]], config: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], int] | None:
    """Each layer's head counts and head width, and the hidden size, from the folder (``per_layer_config``, else
    ``config.json``); None when the folder does not say."""
    config = config or {}
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if not heads or not hidden:
        return None
    keys = ("num_attention_heads", "num_key_value_heads", "head_dim")
    plain = {"head_dim": hidden // heads, **{key: config[key] for key in keys if config.get(key)}}
    widths = list(per_layer.values()) or [plain]
    if not all(all(key in w for key in keys) for w in widths):
        return None
    return widths, int(widths[0].get("hidden_size", hidden))


def _phi3_refusal(per_layer: dict[str, dict[str, Any]], config: dict[str, Any] | None) -> str | None:
    """llama.cpp's phi3 condition on the head counts (:func:`~.gguf_file.phi3_head_refusal`), from the folder."""
    found = _head_widths(per_layer, config)
    return phi3_head_refusal(*found) if found is not None else None


def _query_refusal(
    per_layer: dict[str, dict[str, Any]], config: dict[str, Any] | None, architecture: str
) -> str | None:
    """llama.cpp's qwen2moe / olmoe condition on the query and key widths (:func:`~.gguf_file.query_width_refusal`)."""
    found = _head_widths(per_layer, config)
    return query_width_refusal(*found, architecture) if found is not None else None


def export_verdicts(
    model_type: str,
    per_layer: dict[str, dict[str, Any]] | None,
    modules: list[dict[str, Any]] | None,
    config: dict[str, Any] | None = None,
) -> list[ExportVerdict]:
    """The GGUF and plain-HF verdicts for a folder of ``model_type`` with these per-layer widths and modules;
    ``config`` (``config.json``'s values) gives the widths of a folder without ``per_layer_config``."""
    modules = list(modules or [])
    blocking = _blocking(modules)
    merges = _merges(modules)
    per_layer = per_layer or {}
    hidden = {str(widths.get("hidden_size")) for widths in per_layer.values() if "hidden_size" in widths}
    if len(hidden) > 1:
        blocking = blocking or "per-layer hidden sizes cannot be expressed by a dense decoder"
    varying = sorted(
        {
            key
            for widths in per_layer.values()
            for key in widths
            if len({str(w.get(key)) for w in per_layer.values()}) > 1
        }
    )
    suffix = f"; {merges}" if merges else ""
    verdicts = []
    try:  # the exporter's own rule for the model type and width pattern
        architecture = gguf_architecture(model_type, uniform=not varying)
    except SlimkitError as error:
        verdicts.append(ExportVerdict("gguf", False, str(error)))
    else:
        removed_layers = removed_block_layers(per_layer)
        phi3 = _phi3_refusal(per_layer, config) if architecture == "phi3" else None
        query = _query_refusal(per_layer, config, architecture) if architecture in QUERY_SPANS_HIDDEN else None
        if blocking or phi3 or query:
            verdicts.append(ExportVerdict("gguf", False, blocking or phi3 or query or ""))
        elif architecture in PADDED_ARCHITECTURES and removed_layers:
            verdicts.append(
                ExportVerdict(
                    "gguf",
                    False,
                    f"removed blocks: llama.cpp's {architecture} graph runs every layer's attention and MLP",
                )
            )
        elif architecture in PADDED_ARCHITECTURES and varying:
            verdicts.append(
                ExportVerdict(
                    f"gguf {architecture}",
                    True,
                    f"per-layer {', '.join(varying)} padded with zeros to the widest layer (exact, no speed gain)"
                    f"{suffix}",
                )
            )
        elif varying:
            verdicts.append(ExportVerdict(f"gguf {architecture}", True, f"per-layer {', '.join(varying)}{suffix}"))
        else:
            verdicts.append(ExportVerdict(f"gguf {architecture}", True, f"uniform widths{suffix}"))
    removed = removed_block_layers(per_layer)
    if model_type not in HF_MODEL_TYPES:
        verdicts.append(ExportVerdict("hf", False, f"--format hf writes {', '.join(HF_MODEL_TYPES)} models"))
    elif removed:
        verdicts.append(ExportVerdict("hf", False, removed_blocks_refusal(removed)))
    elif blocking:
        verdicts.append(ExportVerdict("hf", False, blocking))
    elif varying:
        verdicts.append(
            ExportVerdict("hf", False, f"per-layer {', '.join(varying)}: no Hugging Face config expresses them")
        )
    elif per_layer:
        verdicts.append(
            ExportVerdict(
                "hf",
                False,
                "uniform widths the Hugging Face config class refuses (e.g. a hidden size not a multiple "
                "of the head count)",
            )
        )
    else:
        verdicts.append(ExportVerdict("hf", True, f"uniform widths{suffix}"))
    return verdicts


__all__ = ["ExportVerdict", "export_verdicts"]
