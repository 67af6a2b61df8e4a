"""Where the benchmark tools write, under the rules the ``slimkit`` CLI follows: every output option checked before
any work (creating nothing), every file written through a hidden sibling renamed into place.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from benchmarks.core.errors import BenchError
from slimkit.primitives.errors import SlimkitError

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""``benchmarks/results``: where the tools write by default."""


def check_folder_option(option: str, path: Path, writes: str) -> None:
    """One line, before any work, for a folder option (``--out``, ``--keep``) no benchmark may write in: a name no
    file system takes, a protected folder (the root, the home folder, the working directory or a parent of it), an
    existing file, or a file where one of its parent folders would go. ``writes`` says what goes there."""
    from slimkit.primitives.files.guard import check_path_name, protected_reason

    try:
        check_path_name(option, Path(path))
    except SlimkitError as error:
        raise BenchError(str(error)) from None
    reason = protected_reason(Path(path))
    if reason is not None:
        raise BenchError(f"{option} {path} is {reason}; {writes} go in a folder of their own: name a new folder")
    expanded = Path(path).expanduser()
    if expanded.exists() and not expanded.is_dir():
        raise BenchError(f"{option} {path} is a file, not a folder; {writes} go in a folder: name a folder")
    ancestor = expanded.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BenchError(f"{option} {path}: {ancestor} is a file, not a folder")


def check_file_option(option: str, path: Path) -> None:
    """One line, before any work and creating nothing, for a file option (``--json``) that cannot be written: a
    folder, a symbolic link, a missing parent folder, no permission (the rule of ``slimkit eval --json``)."""
    from slimkit.primitives.files.guard import check_file_target

    try:
        check_file_target(option, Path(path))
    except SlimkitError as error:
        raise BenchError(str(error)) from None


def check_base_option(option: str, base: Path, suffixes: tuple[str, ...] = (".json", ".md")) -> None:
    """A results base path (``--out BASE`` writes ``BASE.json`` and ``BASE.md``): each file as a file option where
    its folder exists, else the folder as a folder option (it is created)."""
    if Path(base).parent.exists():
        for suffix in suffixes:
            check_file_option(option, Path(base).with_suffix(suffix))
    else:
        check_folder_option(option, Path(base).parent, "the results")


def dated_base(out: Path, name: str) -> Path:
    """``OUT/<today>-<name>``: where a tool writes its ``.json`` and ``.md`` results."""
    return Path(out) / f"{dt.date.today().isoformat()}-{name}"


def write_text(path: Path, text: str, option: str) -> None:
    """``text`` written to ``path`` atomically (a failure is one line naming ``option``, ``path`` left as it was)."""
    from slimkit.primitives.files.guard import write_text_file

    write_text_file(Path(path), text, option)


def json_text(data: Any, indent: int = 2) -> str:
    """``data`` as the tools write it: indented JSON, values JSON does not know as their ``str``, a final newline."""
    return json.dumps(data, indent=indent, default=str) + "\n"


def write_results(base: Path, result: dict[str, Any], markdown: str, option: str = "--out") -> None:
    """``BASE.json`` (``result``) and ``BASE.md`` (``markdown``), each written atomically."""
    write_text(base.with_suffix(".json"), json_text(result), option)
    write_text(base.with_suffix(".md"), markdown, option)


def emit_json(result: dict[str, Any], path: Path | None, option: str) -> None:
    """Print ``result`` as JSON and, with ``path`` (checked before the work by :func:`check_file_option`), write it
    there atomically."""
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        write_text(path, text + "\n", option)
