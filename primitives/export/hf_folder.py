"""Write a compressed decoder as a plain Hugging Face folder stock transformers loads (``--format hf``).

Method note: docs/methods/export-gguf.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from slimkit.primitives.arch.moe import moe_spec
from slimkit.primitives.arch.spec import hf_model_types
from slimkit.primitives.blocks.remove import removed_blocks
from slimkit.primitives.device.moves import input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export.dense import dense_tensors
from slimkit.primitives.files import marker
from slimkit.primitives.files.atomic import staging_dir, swap_in
from slimkit.primitives.files.removal import discard, remove_owned
from slimkit.primitives.io.compat import removed_blocks_phrase

HF_MODEL_TYPES = hf_model_types()
"""Model types ``--format hf`` writes (:attr:`~slimkit.primitives.arch.spec.ArchSpec.hf_export`; MoE ones in the hub's
per-expert layout, as transformers saves them)."""
EXPORT_MARKER = ".slimkit-export.json"
"""The file an hf export writes last into its folder: which files it wrote (``files``)."""


def write_marker(folder: Path) -> None:
    """Record, in ``folder``'s :data:`EXPORT_MARKER`, every file and folder now in it, at every depth (what this
    export wrote)."""
    marker.write_marker(folder, EXPORT_MARKER, {"written_by": "slimkit export", "format": "hf"})


def written_by_export(folder: Path) -> set[str] | None:
    """The relative paths ``folder``'s :data:`EXPORT_MARKER` lists, or None without a readable one."""
    try:
        return marker.read_marker(folder, EXPORT_MARKER)
    except SlimkitError:
        return None


def check_replaceable_export(folder: Path) -> None:
    """One line unless ``folder`` is an earlier hf export: it holds a ``config.json`` and the export marker (read
    with bounds: :func:`~slimkit.primitives.files.marker.read_marker`), and nothing the marker does not list, at
    any depth, and no mount point or other file system (:func:`~slimkit.primitives.files.removal.survey`)."""
    if not (folder / "config.json").is_file():
        raise SlimkitError(
            f"--out {folder} is not a model folder (no config.json); --force replaces only model folders that "
            "slimkit export wrote"
        )
    try:
        written = marker.read_marker(folder, EXPORT_MARKER)
    except SlimkitError as error:
        why = "" if not os.path.lexists(folder / EXPORT_MARKER) else f": {error}"
        raise SlimkitError(
            f"--out {folder} was not written by slimkit export (no readable {EXPORT_MARKER}{why}); --force replaces "
            "only model folders that slimkit export wrote"
        ) from None
    marker.check_only_listed(
        folder, EXPORT_MARKER, written, "slimkit export", "a folder holding nothing but an earlier export"
    )


def removed_blocks_refusal(removed: dict[str, list[int]]) -> str:
    """Why a model with removed sub-blocks (layers by kind) is no plain Hugging Face folder, in one line."""
    return (
        f"{removed_blocks_phrase(removed)}: a Hugging Face config has no layer without attention or without an MLP; "
        "use --format gguf (llama.cpp's deci architecture skips them) or slimkit.load"
    )


@dataclass
class HfResult:
    path: Path
    merged: list[str]
    added_params: int
    max_abs_logit_diff: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": "hf",
            "path": str(self.path),
            "merged": self.merged,
            "added_params": self.added_params,
            "max_abs_logit_diff": self.max_abs_logit_diff,
        }


def plain_config(model: nn.Module, dense: Any) -> transformers.PretrainedConfig:
    """The model's config with the dense result's uniform widths, hidden size and tie."""
    widths = dense.uniform_widths or dense.layer_widths[0]
    values = model.config.to_dict()
    for key in ("per_layer_config", "transformers_version", "_name_or_path"):
        values.pop(key, None)
    values.update(widths)
    values["hidden_size"] = dense.hidden_size
    values["tie_word_embeddings"] = dense.tied
    try:
        config = type(model.config)(**values)
        config.validate()
    except Exception as error:  # transformers validates widths in the constructor or in validate()
        reason = " ".join(str(error).split()).split("ValueError: ")[-1].rstrip(".")
        raise SlimkitError(
            f"{type(model.config).__name__} refuses these widths ({reason}); use --format gguf or slimkit.load"
        ) from None
    return config


def _check_ids(model: nn.Module) -> torch.Tensor:
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (2, 16), generator=generator)


def write_hf(
    model: nn.Module, tokenizer: Any, directory: str | os.PathLike, verify: bool = True, replace: bool = False
) -> HfResult:
    """Write ``model`` as a plain Hugging Face folder at ``directory``: one that does not exist or is empty, or
    with ``replace`` an earlier export (:func:`check_replaceable_export`, checked again just before the swap),
    swapped out in one step (:func:`~slimkit.primitives.files.atomic.swap_in`) once the new one is complete; the old
    one is deleted afterwards. A symbolic link at ``directory`` is never written through."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in HF_MODEL_TYPES:
        raise SlimkitError(
            f"--format hf writes decoders of types {', '.join(HF_MODEL_TYPES)}; this model is '{model_type}'"
        )
    removed: dict[str, list[int]] = {}
    for block in removed_blocks(model):
        removed.setdefault(block.kind, []).append(block.layer)
    if removed:
        raise SlimkitError(removed_blocks_refusal(removed))
    dense = dense_tensors(model)
    if not dense.uniform:
        varying = sorted(
            {k for w in dense.layer_widths for k in w if any(o.get(k, w[k]) != w[k] for o in dense.layer_widths)}
        )
        if moe_spec(model) is not None:
            raise SlimkitError(
                f"per-layer widths ({', '.join(varying)} vary across layers): neither a Hugging Face config nor "
                "llama.cpp holds per-layer expert counts; prune with allocation: uniform, or serve it with slimkit.load"
            )
        raise SlimkitError(
            f"per-layer widths ({', '.join(varying)} vary across layers) cannot be expressed by a Hugging Face "
            "config; use --format gguf (llama.cpp's deci architecture reads them) or slimkit.load"
        )
    config = plain_config(model, dense)
    with torch.device("meta"):
        plain = type(model)(config)
    expected = set(plain.state_dict())
    missing = expected - set(dense.tensors) - ({"lm_head.weight"} if dense.tied else set())
    extra = set(dense.tensors) - expected
    if missing or extra:
        raise SlimkitError(
            f"the dense weights do not fit a plain {type(model).__name__}: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(extra)[:3]}"
        )
    built = {name: tuple(t.shape) for name, t in plain.state_dict().items()}
    unfit = [n for n, t in dense.tensors.items() if n in built and built[n] != tuple(t.shape)]
    if unfit:  # a width the config has no key for (a shared expert pruned apart from the routed ones)
        raise SlimkitError(
            f"{unfit[0]} has shape {list(dense.tensors[unfit[0]].shape)}, but the {type(model).__name__} its config "
            f"builds holds {list(built[unfit[0]])}: no Hugging Face config key gives that width; use slimkit.load"
        )
    plain.load_state_dict({k: v.detach().to("cpu") for k, v in dense.tensors.items()}, strict=False, assign=True)
    if dense.tied:
        plain.tie_weights()
    target = Path(directory)
    _check_target(target, replace)
    staging = staging_dir(target)
    try:
        plain.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        write_marker(staging)
        difference = _verify(model, staging) if verify else None
        _check_target(target, replace)
        aside = swap_in(staging, target)
        if aside is not None:
            remove_owned(aside, written_by_export(aside) or set())
    finally:
        discard(staging)
    return HfResult(target, dense.merged, dense.added_params, difference)


def _check_target(target: Path, replace: bool) -> None:
    if target.is_symlink():
        raise SlimkitError(f"{target} is a symbolic link; slimkit never writes through one: name the folder itself")
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not replace)):
        raise SlimkitError(f"{target} exists and is not an empty folder")
    if replace and target.is_dir() and any(target.iterdir()):
        check_replaceable_export(target)


def _verify(model: nn.Module, folder: Path) -> float:
    """Load ``folder`` with stock transformers and compare its logits with ``model``'s (one line if not close)."""
    dtype = next(model.parameters()).dtype
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, trust_remote_code=False, use_safetensors=True
    )
    ids = _check_ids(model)
    with torch.no_grad():
        expected = model(ids.to(input_device(model))).logits.float().cpu()
        actual = loaded(ids).logits.float()
    difference = float((expected - actual).abs().max())
    scale = max(float(expected.abs().max()), 1.0)
    tolerance = (1e-4 if dtype == torch.float32 else 5e-2) * scale
    if not difference <= tolerance:
        raise SlimkitError(
            f"the plain folder's logits differ from the compressed model's by {difference:.3g} "
            f"(tolerance {tolerance:.3g}); nothing was written"
        )
    return difference


__all__ = [
    "EXPORT_MARKER",
    "HF_MODEL_TYPES",
    "HfResult",
    "check_replaceable_export",
    "plain_config",
    "removed_blocks_refusal",
    "write_hf",
    "write_marker",
]
