"""A GGUF file shipped in pieces: chunk files spread over several packages, joined and checked against a pinned
sha256 before anything parses them.

Package indexes cap a file's size, so a model's GGUF may come as consecutive byte ranges, one per package
(``gemma3-270m`` in :mod:`slimkit.primitives.io.model_sources`). :func:`chunk_paths` finds each chunk in its installed
package with ``importlib.util.find_spec`` (the packages are never imported: their code does not run);
:func:`assemble_chunks` writes their concatenation to a file and refuses it, in one line, unless its sha256 is the
one slimkit pins (never one the packages carry), so a damaged or swapped chunk never reaches the GGUF reader.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from slimkit.primitives.errors import SlimkitError

_BLOCK = 1 << 20


@dataclass(frozen=True)
class GgufChunk:
    """One byte range of a GGUF: ``file`` inside the installed package ``package`` (pip name ``pip_name``)."""

    package: str
    pip_name: str
    file: str


def package_folder(package: str) -> Path | None:
    """The installed package's folder, found without importing it; None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def chunk_paths(chunks: tuple[GgufChunk, ...], what: str, install: str) -> list[Path]:
    """Each chunk's file, in order; one line naming every missing package or file otherwise (``what``: the source,
    ``install``: the command that installs all of them)."""
    missing: list[str] = []
    paths: list[Path] = []
    for chunk in chunks:
        folder = package_folder(chunk.package)
        path = folder / chunk.file if folder is not None else None
        if path is None or not path.is_file():
            missing.append(chunk.pip_name if folder is None else f"{chunk.pip_name} ({chunk.file} missing)")
        else:
            paths.append(path)
    if missing:
        listed = ", ".join(missing)
        raise SlimkitError(f"{what}: {len(missing)} GGUF chunk package(s) not installed: {listed}; {install}")
    return paths


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def assemble_chunks(paths: list[Path], out: Path, sha256: str, what: str) -> Path:
    """Write the concatenation of ``paths`` to ``out`` and check it against ``sha256``; a mismatch removes ``out``
    and is one :class:`SlimkitError` line (``what``: the source it is for)."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for path in paths:
            with path.open("rb") as source:
                while block := source.read(_BLOCK):
                    digest.update(block)
                    sink.write(block)
    if digest.hexdigest() != sha256:
        out.unlink()
        raise SlimkitError(
            f"{what}: the GGUF joined from {len(paths)} chunk(s) has sha256 {digest.hexdigest()[:16]}..., not the "
            f"pinned {sha256[:16]}...; a chunk package is damaged or not the expected version: reinstall them"
        )
    return out


__all__ = ["GgufChunk", "assemble_chunks", "chunk_paths", "package_folder", "sha256_of"]
