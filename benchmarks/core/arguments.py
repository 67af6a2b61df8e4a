"""Every benchmark tool's command line under the ``slimkit`` CLI's rules: a bad argument (a number out of range, an
unknown name, a path that cannot be read or written) is one ``error: ...`` line on stderr and exit status 2, before
any work and with nothing written. The parsing rules are here once; each tool declares its options with them.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.core.errors import BenchError
from benchmarks.core.outputs import check_base_option, check_file_option, check_folder_option
from benchmarks.core.processes import OFFLINE_ENV, QUIET_ENV
from slimkit.primitives.errors import SlimkitError, unknown

Check = Callable[[str, Any], None]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one :class:`BenchError` line (printed ``error: ...``, exit 2) instead of
    the usage text and a message; the output options it declares are checked by :meth:`parse`, before any work."""

    def __init__(self, module: str, doc: str | None) -> None:
        super().__init__(prog=f"python -m {module}", description=(doc or "").strip().split("\n")[0] or None)
        self.checks: list[tuple[str, str, Check]] = []

    def error(self, message: str) -> NoReturn:
        raise BenchError(message)

    def add_output_folder(self, option: str, writes: str, **kwargs: Any) -> None:
        """A folder the tool writes ``writes`` in (``--out``, ``--keep``): checked by :func:`check_folder_option`."""
        dest = self.add_argument(option, type=Path, **kwargs).dest
        self.checks.append((option, dest, lambda name, path: check_folder_option(name, path, writes)))

    def add_output_file(self, option: str, **kwargs: Any) -> None:
        """One file the tool writes (``--json``): checked by :func:`check_file_option`."""
        dest = self.add_argument(option, type=Path, **kwargs).dest
        self.checks.append((option, dest, check_file_option))

    def add_output_base(self, option: str, suffixes: tuple[str, ...] = (".json", ".md"), **kwargs: Any) -> None:
        """A results base path (``BASE.json`` and ``BASE.md``, or ``suffixes``): checked by
        :func:`check_base_option`."""
        dest = self.add_argument(option, type=Path, **kwargs).dest
        self.checks.append((option, dest, lambda name, base: check_base_option(name, base, suffixes)))

    def parse(self, argv: Sequence[str] | None) -> argparse.Namespace:
        """The parsed arguments, every declared output checked (one line for the first that cannot be written)."""
        args = self.parse_args(argv)
        for option, dest, check in self.checks:
            value = getattr(args, dest)
            for each in value if isinstance(value, list) else [value]:
                if each is not None:
                    check(option, each)
        return args


def bench_main(argv: Sequence[str] | None, body: Callable[[list[str]], int | None]) -> int:
    """A benchmark's ``main``: the offline, quiet environment first (before tqdm is imported: it reads it then),
    then ``body(argv)``; a :class:`BenchError` or any other ``SlimkitError`` prints one ``error:`` line (exit 2),
    Ctrl-C keeps the results written so far (130)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    for key, value in {**OFFLINE_ENV, **QUIET_ENV}.items():
        os.environ.setdefault(key, value)
    try:
        return body(arguments) or 0
    except SlimkitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (the results written so far are kept)", file=sys.stderr)
        return 130


# -- argument types (``type=`` of an option): each raises argparse's error, which the parser prints in one line --


def _refuse(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def integer(low: int = 1) -> Callable[[str], int]:
    """A whole number of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            _refuse(f"{_shown(text)} is not a whole number")
        if value < low:
            _refuse(f"must be at least {low}, got {text.strip()[:40]}")
        return value

    return parse


def number(
    low: float, high: float = math.inf, low_open: bool = True, high_open: bool = False
) -> Callable[[str], float]:
    """A finite number above ``low`` (at least, with ``low_open=False``) and at most ``high`` (below, with
    ``high_open``)."""
    left, right = "(" if low_open else "[", ")" if high_open or math.isinf(high) else "]"
    allowed = f"in {left}{low:g}, {high:g}{right}" if math.isfinite(high) else f"{'>' if low_open else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            _refuse(f"{_shown(text)} is not a number")
        inside = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
        if not math.isfinite(value) or not inside:
            _refuse(f"must be {allowed}, got {_shown(text)}")
        return value

    return parse


fraction = number(0.0, 1.0, high_open=True)
"""A share strictly between 0 and 1 (a ratio removed)."""
share = number(0.0, 1.0)
"""A share above 0 and at most 1."""
positive = number(0.0)
"""A finite number above 0 (seconds, a factor)."""


def names(text: str) -> list[str]:
    """A comma-separated list of at least one name."""
    found = [item.strip() for item in text.split(",") if item.strip()]
    return found or _refuse(f"{_shown(text)} names nothing; give a comma-separated list")


def integers(low: int = 1) -> Callable[[str], list[int]]:
    """A comma-separated list of whole numbers of at least ``low``."""
    one = integer(low)
    return lambda text: [one(item) for item in names(text)]


def one_of(kind: str, allowed: Callable[[], Iterable[str]]) -> Callable[[str], str]:
    """A name among ``allowed()`` (called when parsing: the bundled recipes, the known shapes)."""

    def parse(text: str) -> str:
        known = list(allowed())
        return text if text in known else _refuse(unknown(kind, text, known))

    return parse


def some_of(kind: str, allowed: Callable[[], Iterable[str]]) -> Callable[[str], list[str]]:
    """A comma-separated list of names among ``allowed()``."""
    one = one_of(kind, allowed)
    return lambda text: [one(item) for item in names(text)]


def bundled_recipes() -> list[str]:
    from slimkit.recipes.loading import bundled_recipes as found

    return sorted(found())


recipe = one_of("recipe", bundled_recipes)
"""A bundled recipe's name."""
recipes = some_of("recipe", bundled_recipes)


def _slimkit_check(check: Callable[[str, str], Any], text: str) -> Any:
    """``check(text, field)`` with its one-line error (``field: message``) as argparse's."""
    try:
        return check(text, "value")
    except SlimkitError as error:
        _refuse(str(error).removeprefix("value: "))


def device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N (the hardware is not checked: rows may be assembled on another machine)."""
    from slimkit.primitives.device.placement import check_device_name

    return str(_slimkit_check(check_device_name, text))


def device(text: str) -> str:
    """A device this machine has: auto, cpu, cuda or cuda:N."""
    from slimkit.primitives.device.placement import resolve_device

    _slimkit_check(resolve_device, text)
    return text


def dtype_name(text: str) -> str:
    """auto, float32, bfloat16 or float16."""
    from slimkit.primitives.device.placement import check_dtype_name

    return str(_slimkit_check(check_dtype_name, text))


def dtype(text: str) -> str:
    """float32, bfloat16 or float16 (no auto)."""
    return dtype_name(text) if text != "auto" else _refuse("give float32, bfloat16 or float16")


def size(text: str) -> str:
    """A memory size such as 20GiB or 512MB."""
    from slimkit.primitives.device.placement import parse_size

    _slimkit_check(parse_size, text)
    return text


def model_source(text: str) -> str:
    """A named model source or a model folder (its config checked, no weight read, nothing converted)."""
    from slimkit.primitives.io.model_sources import SOURCES, check_source

    if text not in SOURCES:
        _slimkit_check(lambda value, _field: check_source(value), text)
    return text


def gguf_type(text: str) -> str:
    """A GGUF tensor type slimkit exports: f32, f16, bf16 or q8_0."""
    from slimkit.primitives.export.gguf_file import GGUF_TYPES

    return one_of("GGUF type", lambda: GGUF_TYPES)(text)


def corpus(text: str) -> str:
    """A shipped text corpus (wikitext2, ptb, c4, alpaca)."""
    from slimkit.primitives.datasets.textdata import CORPORA

    return one_of("dataset", lambda: CORPORA)(text)


def input_file(text: str) -> Path:
    """A regular file to read (not a folder, FIFO or device)."""
    from slimkit.primitives.io.folder import check_regular_file

    _slimkit_check(lambda value, _field: check_regular_file(Path(value)), text)
    return Path(text)


def input_folder(text: str) -> Path:
    """An existing folder to read."""
    path = Path(text).expanduser()
    return path if path.is_dir() else _refuse(f"{text}: no such folder")


def file_name(text: str) -> str:
    """One file-name part (``--name``): no path separator, not ``.`` or ``..``, no NUL, at most 200 bytes."""
    if not text or text in (".", "..") or "/" in text or "\0" in text or len(os.fsencode(text)) > 200:
        _refuse(f"{_shown(text)} is not a file name; give a name without '/' (at most 200 bytes)")
    return text
