"""Export compressed models to inference engines: GGUF for llama.cpp, plain Hugging Face folders.

Method note: docs/methods/export-gguf.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export.dense import DenseModel, dense_tensors
from slimkit.primitives.export.gguf_file import EXPORTABLE_MODEL_TYPES, GGUF_TYPES, GgufResult, write_gguf
from slimkit.primitives.export.hf_folder import (
    EXPORT_MARKER,
    HF_MODEL_TYPES,
    HfResult,
    check_replaceable_export,
    write_hf,
)
from slimkit.primitives.files.atomic import remove_leftovers
from slimkit.primitives.files.guard import check_output_location, terminate_as_interrupt, write_failure
from slimkit.primitives.files.lock import claim_output
from slimkit.primitives.files.writable import check_writable
from slimkit.primitives.io.finite import check_finite_weights
from slimkit.primitives.io.folder import read_json_object
from slimkit.primitives.io.model_sources import load_source, resolve_source
from slimkit.primitives.io.paths import as_path, check_path_length, path_text

FORMATS = ("gguf", "hf")
GGUF_MAGIC = b"GGUF"


def check_export_args(format: str, type: str | None) -> str | None:
    """One line for an unknown format or type; returns the type to use (gguf default f16)."""
    if format not in FORMATS:
        raise SlimkitError(f"export format '{format}' is not one of {', '.join(FORMATS)}")
    if format == "gguf":
        if type is None:
            return "f16"
        if type not in GGUF_TYPES:
            raise SlimkitError(f"GGUF type '{type}' is not one of {', '.join(GGUF_TYPES)}")
        return type
    if type is not None:
        raise SlimkitError("--type applies to --format gguf only (a Hugging Face folder keeps the model's dtype)")
    return None


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_export_target(
    format: str, out: str | os.PathLike, force: bool, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """The output path, checked before any work: never a protected folder or one of ``inputs`` (the model folder:
    itself, inside it or holding it); what exists there may be replaced only with ``force`` and only when it is an
    earlier export of the same kind."""
    target = as_path(out, "--out")
    check_output_location("--out", target, inputs, "an export")
    check_path_length("--out", target)
    if format == "gguf":
        if target.is_dir():
            raise SlimkitError(f"--out {target} is a folder; give a file name such as {target / 'model.gguf'}")
        if target.exists():
            if not force:
                raise SlimkitError(f"--out {target} exists; pass --force to replace it")
            if not _is_gguf(target):
                raise SlimkitError(f"--out {target} exists and is not a GGUF file; --force replaces only GGUF files")
    else:
        if target.exists() and not target.is_dir():
            raise SlimkitError(f"--out {target} exists and is not a folder")
        if target.is_dir() and any(target.iterdir()):
            if not force:
                raise SlimkitError(f"--out {target} exists and is not empty; pass --force to replace it")
            check_replaceable_export(target)
    check_writable("--out", target)
    return target


def saved_dtype(source: str | os.PathLike) -> str:
    """The dtype a folder's weights were saved in (its config's ``dtype``), so an export loads a bf16 model
    as bf16 instead of doubling it to float32; ``auto`` when unknown (a named source)."""
    try:
        data = read_json_object(Path(source) / "config.json")
    except SlimkitError:  # a named source, or a config the load that follows refuses in one line
        return "auto"
    name = str(data.get("dtype") or data.get("torch_dtype") or "auto")
    return name if name in ("float32", "bfloat16", "float16") else "auto"


def export(
    model: nn.Module | str | os.PathLike,
    out: str | os.PathLike,
    format: str = "gguf",
    type: str | None = None,
    *,
    tokenizer: Any = None,
    force: bool = False,
    verify: bool = True,
) -> GgufResult | HfResult:
    """Export ``model`` (a loaded model with ``tokenizer``, or a source name / folder) to ``out``.

    Returns a :class:`GgufResult` or :class:`HfResult` (``as_dict()`` for a report). Raises
    :class:`SlimkitError` with one line for bad arguments, an occupied ``out``, an unsupported model
    or a structure with no exact merge; nothing is left at ``out`` then.
    """
    type = check_export_args(format, type)
    if not isinstance(model, nn.Module):
        model = path_text(model, "model")
    inputs = [] if isinstance(model, nn.Module) else [resolve_source(model)[0]]
    target = check_export_target(format, out, force, inputs)
    lock = claim_output(target, "export")
    try:
        with terminate_as_interrupt():
            return _export_claimed(model, target, format, type, tokenizer, force, verify, inputs)
    except OSError as error:  # a full disk, a file-size limit, a folder that became unwritable
        raise write_failure(f"--out {target}", error) from None
    except SafetensorError as error:  # the same, met while safetensors wrote the weights
        raise SlimkitError(f"--out {target}: cannot write the weights ({error}); nothing was replaced") from None
    except MemoryError:
        raise SlimkitError(
            f"--out {target}: the export ran out of host memory (the machine's, or the process's limit: ulimit -v); "
            "nothing was replaced: free memory or raise the limit"
        ) from None
    finally:
        lock.release()


def _export_claimed(
    model: nn.Module | str | os.PathLike,
    target: Path,
    format: str,
    type: str | None,
    tokenizer: Any,
    force: bool,
    verify: bool,
    inputs: list[Path],
) -> GgufResult | HfResult:
    """The export once this process holds ``target``'s lock."""
    remove_leftovers(target, marker=EXPORT_MARKER if format == "hf" else None)  # what a killed export left
    check_export_target(format, target, force, inputs)  # again, now that no other export writes it
    what = "the model given"
    if not isinstance(model, nn.Module):
        what = f"model {model}"
        model, tokenizer, _ = load_source(str(model), device="cpu", dtype=saved_dtype(model))
    check_finite_weights(model, what)  # nothing non-finite leaves in an export
    if tokenizer is None and format == "gguf":
        raise SlimkitError("GGUF export needs the model's tokenizer (pass tokenizer=...)")
    if format == "gguf":
        return write_gguf(model, tokenizer, target, type=type or "f16", replace=force)
    return write_hf(model, tokenizer, target, verify=verify, replace=force)


def result_lines(result: dict[str, Any]) -> list[str]:
    """An export result in a few lines (the CLI and the run report)."""
    if result["format"] == "gguf":
        lines = [
            f"wrote {result['path']}: GGUF {result['architecture']} {result['type']}, "
            f"{result['bytes'] / 2**20:.1f} MiB, {result['tensors']} tensors"
        ]
    else:
        check = result.get("max_abs_logit_diff")
        verified = "not verified" if check is None else f"stock from_pretrained logits within {check:.2g}"
        lines = [f"wrote {result['path']}: plain Hugging Face folder ({verified})"]
    for item in result.get("merged", []):
        lines.append(f"merged {item}")
    if result.get("added_params"):
        lines.append(f"the dense form has {result['added_params']:,} more parameters than the slimkit model")
    fallbacks = result.get("fallbacks") or []
    if fallbacks:
        lines.append(
            f"{len(fallbacks)} tensors fell back to f16: "
            + "; ".join(fallbacks[:3])
            + (" ..." if len(fallbacks) > 3 else "")
        )
    lines += [f"warning: {text}" for text in result.get("warnings", [])]
    return lines


__all__ = [
    "EXPORTABLE_MODEL_TYPES",
    "FORMATS",
    "HF_MODEL_TYPES",
    "DenseModel",
    "GgufResult",
    "HfResult",
    "check_export_args",
    "check_export_target",
    "dense_tensors",
    "export",
    "result_lines",
    "write_gguf",
    "write_hf",
]
