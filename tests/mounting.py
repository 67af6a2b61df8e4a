"""Mounts for tests that need one: a bind mount or a tmpfs inside a test's own folder, always unmounted.

Mounting needs privileges (root, or a user namespace); where the kernel refuses, the test is skipped with the
reason, never failed.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(args: list[str], what: str) -> None:
    if shutil.which("mount") is None:
        pytest.skip(f"cannot {what}: no mount command here")
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot {what} here ({done.stderr.strip() or done.returncode}); mounting needs privileges")


def _unmount(target: Path) -> None:
    if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@contextmanager
def bind_mount(source: Path, target: Path) -> Iterator[Path]:
    """``source`` shown at ``target`` too (``mount --bind``: the same file system, the same device number)."""
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.touch()
    _mount(["--bind", str(source), str(target)], f"bind-mount {source} at {target}")
    try:
        yield target
    finally:
        _unmount(target)


@contextmanager
def tmpfs(target: Path) -> Iterator[Path]:
    """A small new tmpfs at ``target`` (another file system: its own device number)."""
    target.mkdir(parents=True, exist_ok=True)
    _mount(["-t", "tmpfs", "-o", "size=4m", "tmpfs", str(target)], f"mount a tmpfs at {target}")
    try:
        yield target
    finally:
        _unmount(target)
