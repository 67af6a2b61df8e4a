"""A model folder checked before anything reads its weights (:func:`check_model_folder`).

Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from safetensors import SafetensorError, safe_open

from slimkit.primitives.arch import ARCH_SPECS, check_supported
from slimkit.primitives.arch.moe import fused_expert_shapes
from slimkit.primitives.arch.support import check_evaluable, check_no_custom_code, task_of
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.compat import is_marked, removed_block_layers, unmark_config

Purpose = Literal["compress", "evaluate"]
"""What a model folder is read for: ``compress`` needs an architecture slimkit has an adapter for; ``evaluate``
(``slimkit eval``, ``slimkit inspect``) takes any causal LM transformers builds with its own classes."""

MAX_JSON_BYTES = 64 << 20
"""The largest JSON file of a model folder slimkit reads (a config is a few KiB; chat templates make more)."""
MAX_JSON_DEPTH = 32
"""How deeply a model folder's JSON may nest (a real config nests 3 or 4 levels)."""
SIDE_JSON_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
"""JSON files transformers reads beside ``config.json``, checked like it when present."""
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
"""Weight files slimkit never reads: unpickling them can run code."""
INDEX_SUFFIX = ".safetensors.index.json"
SIZE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "ffn_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "word_embed_proj_dim",
    "max_position_embeddings",
)
"""Config fields that size a model: each must be a positive integer (``num_key_value_heads`` and ``head_dim`` may
be null)."""
_NULLABLE = ("num_key_value_heads", "head_dim")
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""Fields every architecture slimkit compresses reads its widths from: without one transformers would build its
default width, not the saved one."""
FIELD_GIVEN_BY = {"num_hidden_layers": ("layers_block_type", "hybrid_override_pattern")}
"""Other keys a config gives a required field by (Nemotron-H's depth is the length of its layer list)."""
POSITIVE_SCALARS = (
    "logits_scaling",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "logit_scale",
    "lm_head_multiplier",
    "logits_soft_cap",
    "output_logit_soft_cap",
    "embedding_multiplier",
    "attention_multiplier",
    "residual_multiplier",
    "query_pre_attn_scalar",
)
"""Config scalars the forward divides by, caps at or multiplies into the stream or the logits: a finite positive
number or null (a negative cap is a cap at its magnitude, a zero one divides by zero)."""
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config keys of a mixture-of-experts model's routed expert count (the first one present)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
"""Files a model folder's tokenizer is loaded from (one of them is enough)."""
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""Stored dtypes a weight (a ``.weight`` or ``.bias`` tensor) may have: integer, boolean and 8-bit float tensors are
a quantised checkpoint, which transformers would cast to float without their scales."""
_NOT_WIDTHS = ("num_hidden_layers", "max_position_embeddings")
_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _kind(mode: int) -> str:
    return _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")


def check_regular_file(path: Path) -> os.stat_result:
    """``path``'s status when it is a regular file (after symbolic links); one line otherwise, without opening it."""
    try:
        status = path.stat()
    except OSError as error:
        raise SlimkitError(f"cannot read {path}: {error.strerror or error}") from None
    if not stat.S_ISREG(status.st_mode):
        raise SlimkitError(f"{path} is {_kind(status.st_mode)}, not a regular file; slimkit reads regular files only")
    return status


def check_folder_entries(directory: Path) -> None:
    """Every entry of ``directory`` is a regular file or a folder (a broken symbolic link is left to the reader)."""
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise SlimkitError(
                f"{directory / entry.name} is {_kind(mode)}, not a regular file; a model folder holds regular files "
                "only (reading it could block forever)"
            )


def json_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON) nests: 0 for a scalar, 1 for a flat object or list."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
    return deepest


def read_json_object(
    path: Path, *, max_bytes: int = MAX_JSON_BYTES, follow_symlinks: bool = True, what: str = "a JSON file"
) -> dict[str, Any]:
    """A model folder's JSON object file, or one :class:`SlimkitError` line naming the file and what is wrong.

    At most ``max_bytes`` are read (the size is checked on the opened file, so a file that grows is cut off, and
    ``/dev/zero`` or a FIFO is refused without reading); with ``follow_symlinks`` False a symbolic link at ``path``
    is refused (``what`` names the file in that line)."""
    if not follow_symlinks and path.is_symlink():
        raise SlimkitError(f"{path} is a symbolic link; slimkit reads {what} only as a plain file")
    size = check_regular_file(path).st_size
    limit = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes:,} bytes"
    if size > max_bytes:
        raise SlimkitError(f"{path}: {size:,} bytes, more than the {limit} {what} may hold")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0))
    try:
        handle = os.open(path, flags)
    except OSError as error:
        raise SlimkitError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode):  # swapped since it was checked
            raise SlimkitError(
                f"{path} is {_kind(status.st_mode)}, not a regular file; slimkit reads regular files only"
            )
        with os.fdopen(handle, "rb", closefd=False) as stream:  # a buffer the file's size, not the limit's
            raw = stream.read(min(max_bytes, status.st_size) + 1)
            if len(raw) > status.st_size:  # it grew since it was measured: read on, to the limit
                raw += stream.read(max_bytes + 1 - len(raw))
    except OSError as error:
        raise SlimkitError(f"cannot read {path}: {error.strerror or error}") from None
    finally:
        os.close(handle)
    if len(raw) > max_bytes:
        raise SlimkitError(f"{path}: more than the {limit} {what} may hold")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SlimkitError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise SlimkitError(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as error:
        raise SlimkitError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise SlimkitError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise SlimkitError(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep")
    return data


@dataclass(frozen=True)
class ModelFolder:
    """A model folder whose files passed :func:`check_model_folder`."""

    path: Path
    config: dict[str, Any]
    """``config.json`` as saved (still marked for a slimkit-only folder)."""
    task: str
    shapes: dict[str, tuple[int, ...]]
    """Every saved tensor's shape, from the safetensors headers (no weights are read)."""
    files: dict[str, str]
    """The weight file that holds each tensor."""

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def weight_files(self) -> list[Path]:
        """Exactly the weight files the checkpoint names (the only ones any loader reads)."""
        return [self.path / name for name in sorted(set(self.files.values()))]

    @property
    def largest_dimension(self) -> int:
        """The largest dimension of any saved tensor: a bound on every width the folder's JSON may give."""
        return max((max(shape) for shape in self.shapes.values() if shape), default=0)


def _index_weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SlimkitError(f"{index}: no 'weight_map' object of tensor names to file names")
    for name in sorted(set(weight_map.values())):
        if not name.endswith(".safetensors") or Path(name).name != name or name.startswith("."):
            raise SlimkitError(f"{index}: names {name!r}, which is not a .safetensors file name in the folder")
    return weight_map


def _weight_files(directory: Path) -> tuple[list[Path], Path | None, dict[str, str] | None]:
    """The weight files to read, the shard index naming them (None: one file) and its weight map."""
    present = sorted(p.name for p in directory.glob("*.safetensors"))
    indexes = sorted(directory.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise SlimkitError(
            f"{directory} holds {len(indexes)} shard indexes ({', '.join(p.name for p in indexes)}); "
            "a checkpoint has one: remove the stray one"
        )
    if indexes:
        index = indexes[0]
        weight_map = _index_weight_map(index)
        named = sorted(set(weight_map.values()))
        missing = [name for name in named if name not in present]
        if missing:
            raise SlimkitError(f"{index}: names weight file(s) the folder lacks: {', '.join(missing[:3])}")
        unlisted = [name for name in present if name not in named]
        if unlisted:
            raise SlimkitError(
                f"{directory / unlisted[0]} is a weights file {index.name} does not name; slimkit reads exactly the "
                "files the index names: remove the stray file (or list it in the index)"
            )
        return [directory / name for name in named], index, weight_map
    if len(present) > 1:
        raise SlimkitError(
            f"{directory} holds {len(present)} weight files ({', '.join(present[:3])}) and no shard index; a "
            "checkpoint is one .safetensors file or the shards a *.safetensors.index.json names: remove the stray files"
        )
    if present:
        return [directory / present[0]], None, None
    pickles = sorted({p.name for pattern in PICKLE_PATTERNS for p in directory.glob(pattern)})
    if pickles:
        raise SlimkitError(
            f"{directory} holds only pickle weights ({', '.join(pickles[:3])}); slimkit reads safetensors only "
            "(unpickling can run code): convert them to model.safetensors with a tool you trust"
        )
    raise SlimkitError(f"{directory} holds no weights (no *.safetensors file)")


def _read_headers(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for file in files:
        check_regular_file(file)
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    if key in where:
                        raise SlimkitError(
                            f"{file} holds {key}, which {where[key]} holds too; each tensor must be in one weight "
                            "file (a stray copy would replace the real one): remove the stray file"
                        )
                    tensor = handle.get_slice(key)
                    shapes[key] = tuple(tensor.get_shape())
                    where[key] = file.name
                    dtype = str(tensor.get_dtype())
                    if key.endswith((".weight", ".bias")) and dtype not in FLOAT_DTYPES:
                        raise SlimkitError(
                            f"{file}: {key} is stored as {dtype}, not a floating-point type; slimkit reads "
                            "unquantised floating-point weights (a quantised checkpoint needs its scales): give the "
                            "unquantised model"
                        )
        except (SafetensorError, OSError) as error:
            reason = " ".join(str(error).split()) or type(error).__name__
            raise SlimkitError(
                f"{file}: not a readable safetensors file ({reason}); it is truncated or damaged: save or copy it again"
            ) from None
    return shapes, where


def _check_weight_map(index: Path, weight_map: dict[str, str], where: dict[str, str]) -> None:
    """The index and the files' headers agree on which file holds each tensor."""
    for key, name in weight_map.items():
        if where.get(key) != name:
            held = f"{where[key]} holds it" if key in where else "no weight file holds it"
            raise SlimkitError(f"{index}: puts {key} in {name}, but {held}")
    unlisted = sorted(set(where) - set(weight_map))
    if unlisted:
        raise SlimkitError(f"{index}: does not list {unlisted[0]}, which {where[unlisted[0]]} holds")


def _check_config_fields(config: dict[str, Any], path: Path) -> None:
    """Fields whose values make transformers fail or read something else: quantisation, architectures, sizes."""
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise SlimkitError(
            f"{path}: quantization_config (quant_method {method}) describes quantised weights; slimkit compresses "
            "and reads unquantised safetensors weights only: give the unquantised model"
        )
    model_type = config.get("model_type")
    architectures = config.get("architectures")
    if architectures is not None:
        if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
            raise SlimkitError(f"{path}: architectures must be a list of class names, got {json.dumps(architectures)}")
        for name in architectures:
            if not _is_model_class(name, model_type):
                raise SlimkitError(
                    f"{path}: architectures names {name!r}, which is not a transformers model class for model_type "
                    f"'{model_type}'; slimkit builds built-in classes of the config's model_type only"
                )
    for name in SIZE_FIELDS:
        if name not in config or (config[name] is None and name in _NULLABLE):
            continue
        value = config[name]
        if type(value) is not int or value < 1:
            raise SlimkitError(f"{path}: {name} must be a positive integer, got {json.dumps(value)}")
    if model_type in ARCH_SPECS:
        missing = [
            name
            for name in REQUIRED_FIELDS
            if name not in config and not any(key in config for key in FIELD_GIVEN_BY.get(name, ()))
        ]
        if missing:
            raise SlimkitError(
                f"{path}: no {missing[0]}; transformers would build the model with its default {missing[0]}, not "
                "the saved weights' (a saved config names every width)"
            )
    for name in POSITIVE_SCALARS:
        value = config.get(name)
        if value is None:
            continue
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise SlimkitError(f"{path}: {name} must be a finite positive number or null, got {json.dumps(value)}")
    _check_routing(config, path)


def _check_routing(config: dict[str, Any], path: Path) -> None:
    """A mixture-of-experts config routes each token to at most the experts it has (a count of 0: no routed experts,
    as in Granite 4.0-H's dense variant, whose config keeps a default top-k)."""
    top_k = config.get("num_experts_per_tok")
    count_key = next((key for key in EXPERT_COUNT_KEYS if isinstance(config.get(key), int)), None)
    if top_k is None or count_key is None or config[count_key] == 0:
        return
    count = config[count_key]
    if type(top_k) is not int or top_k < 1:
        raise SlimkitError(f"{path}: num_experts_per_tok must be a positive integer, got {json.dumps(top_k)}")
    if count < 1 or top_k > count:
        raise SlimkitError(
            f"{path}: num_experts_per_tok {top_k} is more than the {count} experts a layer has ({count_key}); the "
            "router picks at most every expert"
        )


def _is_model_class(name: str, model_type: Any) -> bool:
    import transformers

    if not name.isidentifier():
        return False
    cls = getattr(transformers, name, None)
    return (
        isinstance(cls, type)
        and issubclass(cls, transformers.PreTrainedModel)
        and getattr(getattr(cls, "config_class", None), "model_type", None) == model_type
    )


def _check_sizes(folder: ModelFolder, config: dict[str, Any]) -> None:
    """The config's layer count is the weights' and its widths fit them, before any model is built from it."""
    path, largest = folder.config_path, folder.largest_dimension
    spec = ARCH_SPECS.get(str(config.get("model_type")))
    for name in SIZE_FIELDS:
        value = config.get(name)
        learned_positions = name == "max_position_embeddings" and spec is not None and bool(spec.extra_embeddings)
        if isinstance(value, int) and (name not in _NOT_WIDTHS or learned_positions) and value > largest:
            raise SlimkitError(
                f"{path}: {name} {value} is larger than any dimension of the saved weights (at most {largest}); "
                "the config does not describe these weights"
            )
    layers = config.get("num_hidden_layers")
    if spec is None or not isinstance(layers, int):
        return
    pattern = re.compile(rf"(?:^|\.){re.escape(spec.layers)}\.(\d+)\.")
    held = {int(match[1]) for key in folder.shapes if (match := pattern.search(key))}
    # A layer whose attention and MLP blocks were both removed holds no tensor (primitives/blocks).
    removed = removed_block_layers(config.get("per_layer_config"))
    empty = set(removed.get("attention", ())) & set(removed.get("mlp", ()))
    held = sorted(held | {index for index in empty if index < layers})
    if len(held) != layers or held != list(range(len(held))):
        what = f"layers {held[0]}-{held[-1]}" if held and held == list(range(held[0], held[-1] + 1)) else None
        what = what or (f"layers {', '.join(map(str, held[:8]))}" if held else "no layers")
        raise SlimkitError(
            f"{path}: num_hidden_layers {layers} disagrees with the weights, which hold {what} "
            f"({len(held)} layer{'' if len(held) == 1 else 's'})"
        )


def check_tokenizer_files(directory: str | os.PathLike, needed_for: str) -> None:
    """Refuse, in one line, a model folder with none of :data:`TOKENIZER_FILES` when ``needed_for`` (e.g.
    ``perplexity``) tokenises text with the model's own tokenizer."""
    folder = Path(directory)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise SlimkitError(
            f"model folder {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); {needed_for} needs the "
            "model's own tokenizer: copy its tokenizer files into the folder"
        )


def _mentioned_fields(text: str, config: dict[str, Any]) -> list[str]:
    """The config's keys a message names, as ``hidden_size`` or as words (``the hidden size``, ``attention heads``)."""
    words = re.sub(r"[^a-z0-9]+", " ", text.lower())
    found = []
    for key in config:
        parts = [part for part in key.lower().split("_") if part not in ("num", "n", "of")]
        if key.lower() in text.lower() or (parts and f" {' '.join(parts)} " in f" {words} "):
            found.append(key)
    return found


def config_error_line(path: Path, error: BaseException, config: dict[str, Any]) -> str:
    """transformers' refusal of ``config`` (a config validation error) as one line naming the field(s) it is about."""
    cause = error.__cause__ if error.__cause__ is not None else error
    text = " ".join(str(cause).split()) or type(cause).__name__
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text.split(". Errors:")[0]).rstrip(".")
    field = getattr(error, "field", None) or re.match(r"Validation error for field '(\w+)'", str(error))
    names = [field[1]] if isinstance(field, re.Match) else [field] if isinstance(field, str) else []
    names = names or _mentioned_fields(text, config)
    subject = ", ".join(f"{name} {json.dumps(config[name])[:40]}" if name in config else name for name in names)
    return f"{path}: {subject or 'the config'}: transformers refuses it ({text[:300]})"


def check_model_folder(
    directory: str | os.PathLike, task: str | None = None, *, purpose: Purpose = "compress"
) -> ModelFolder:
    """Validate a model folder before transformers reads any of it; one :class:`SlimkitError` line otherwise.

    Checks, in order: every entry is a regular file or folder; ``config.json`` is a bounded JSON object; the folder
    needs no code of its own (:func:`~slimkit.primitives.arch.support.check_no_custom_code`); the config names a
    supported ``model_type`` for ``task`` (default: from the config; with ``purpose="evaluate"`` any causal LM
    transformers builds with its own classes, :func:`~slimkit.primitives.arch.support.check_evaluable`, except a folder
    slimkit wrote, which needs its adapter), no quantisation, model classes of that type and positive sizes; the side
    JSON files read; the weights are exactly the safetensors files the checkpoint names (pickle-only folders are
    refused) and every header reads; the layer count and widths fit the weights.
    """
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise SlimkitError(f"model folder {directory} does not exist")
    config_path = directory / "config.json"
    if not os.path.lexists(config_path):
        raise SlimkitError(f"{directory} is not a model folder (no config.json)")
    check_folder_entries(directory)
    config = read_json_object(config_path)
    for name in SIDE_JSON_FILES:
        if (directory / name).exists():
            read_json_object(directory / name)
    check_no_custom_code(directory, config)
    if not config.get("model_type"):
        raise SlimkitError(f'{config_path}: no model_type (a Hugging Face config names its architecture, e.g. "llama")')
    try:
        if purpose == "evaluate" and not is_marked(config):
            task = check_evaluable(config, task)
        else:
            task = task or task_of(config)
            check_supported(config, task)
        plain = unmark_config(config)
    except SlimkitError as error:
        raise SlimkitError(f"{config_path}: {error}") from None
    _check_config_fields(plain, config_path)
    files, index, weight_map = _weight_files(directory)
    shapes, where = _read_headers(files)
    if index is not None and weight_map is not None:
        _check_weight_map(index, weight_map, where)
    # the hub's per-expert tensors of a MoE model, as the fused ones transformers builds from them
    fused = fused_expert_shapes(plain.get("model_type"), shapes)
    folder = ModelFolder(directory, config, task, fused, {**where, **_fused_files(fused, where)})
    _check_sizes(folder, plain)
    return folder


def _fused_files(fused: dict[str, tuple[int, ...]], where: dict[str, str]) -> dict[str, str]:
    """The weight file of each fused expert tensor (a name no file holds as such): the file holding its layer's
    per-expert tensors."""
    layer = re.compile(r"^(.*?layers\.\d+\.)")
    files: dict[str, str] = {}
    for name in fused.keys() - where.keys():
        prefix = layer.match(name)
        found = [file for key, file in where.items() if prefix is not None and key.startswith(prefix.group(1))]
        files[name] = found[0] if found else next(iter(where.values()), "")
    return files


__all__ = [
    "EXPERT_COUNT_KEYS",
    "FLOAT_DTYPES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "PICKLE_PATTERNS",
    "POSITIVE_SCALARS",
    "REQUIRED_FIELDS",
    "SIZE_FIELDS",
    "TOKENIZER_FILES",
    "ModelFolder",
    "Purpose",
    "check_folder_entries",
    "check_model_folder",
    "check_regular_file",
    "check_tokenizer_files",
    "config_error_line",
    "json_depth",
    "read_json_object",
]
