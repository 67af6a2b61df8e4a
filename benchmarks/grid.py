"""The benchmark grid as data: which recipes run at which ratios, with which budgets and claims.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from benchmarks.claims import parse_check
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_yaml_file
from slimkit.primitives.errors import format_validation_error
from slimkit.primitives.evaluate.eval_settings import check_zeroshot_task
from slimkit.primitives.settings import Strict
from slimkit.recipes.schema import DeviceName, DtypeName

GRID_FILE = Path(__file__).resolve().parent / "grid.yaml"
DENSE = "dense"
DEFAULT_CLAIM_METRICS = ("wikitext2_ppl", "ptb_ppl")


def _check_ratio(value: float) -> float:
    if not 0.0 < value < 1.0:
        raise ValueError(f"ratio {value} is not in (0, 1)")
    return value


class Speed(Strict):
    rounds: int = Field(5, ge=1)
    prompt_len: int = Field(128, ge=1)
    new_tokens: int = Field(32, ge=1)
    batch: int = Field(1, ge=1)


class Settings(Strict):
    model: str = "smollm2-135m"
    ratios: list[float] = Field(default_factory=lambda: [0.1, 0.2, 0.3], min_length=1)
    ppl_datasets: list[str] = Field(default_factory=lambda: ["wikitext2", "ptb"])
    ppl_window: int = Field(512, ge=2)
    ppl_tokens: int = Field(16384, ge=2)
    zeroshot_tasks: list[str] = Field(default_factory=list)
    zeroshot_limit: int | None = Field(200, ge=0)
    """Examples per zero-shot task (the first N of each); 0 skips zero-shot evaluation, None evaluates
    every example. 200 is the floor for a claims run."""
    speed: Speed = Field(default_factory=Speed)
    device: DeviceName = "auto"
    """Where every row is compressed and evaluated (``slimkit recipe run --device``): auto, cpu, cuda, cuda:N."""
    dtype: DtypeName = "auto"
    """The weights' dtype for compression and evaluation (``--dtype``): auto (float32 on CPU, bfloat16 on
    CUDA), float32, bfloat16, float16. A claims run on a GPU sets float32 so its rows compare with CPU rows."""

    @field_validator("ratios")
    @classmethod
    def _ratios(cls, values: list[float]) -> list[float]:
        return [_check_ratio(v) for v in values]

    @field_validator("zeroshot_tasks")
    @classmethod
    def _tasks(cls, names: list[str]) -> list[str]:
        return [check_zeroshot_task(n) for n in names]

    def check(self) -> None:
        if self.ppl_tokens < self.ppl_window:
            raise BenchError(
                f"the perplexity budget ({self.ppl_tokens} tokens) is below one window of {self.ppl_window}"
            )

    @property
    def zeroshot_on(self) -> bool:
        return bool(self.zeroshot_tasks) and self.zeroshot_limit != 0

    def for_job(self, job: Job) -> Settings:
        """The settings a job is evaluated under: these, without zero-shot for a ``zeroshot: false`` row."""
        return self if job.zeroshot else self.model_copy(update={"zeroshot_tasks": [], "zeroshot_limit": 0})


class Entry(Strict):
    recipe: str = Field(min_length=1)
    label: str | None = Field(None, min_length=1)
    """The row's name instead of the recipe's, for one recipe run with several overrides (a sweep)."""
    ratios: list[float] | None = None
    recovery: list[bool] = Field(default_factory=lambda: [False], min_length=1)
    overrides: list[str] = Field(default_factory=list)
    seeds: list[int] | None = Field(None, min_length=1)
    """One compression per seed (``--set seed=N``), aggregated into the row; None: one draw."""
    zeroshot: bool = True
    """False: the entry's rows skip zero-shot evaluation (no claim reads it; it is the costly part)."""

    @field_validator("ratios")
    @classmethod
    def _ratios(cls, values: list[float] | None) -> list[float] | None:
        return None if values is None else [_check_ratio(v) for v in values]

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, values: list[int] | None) -> list[int] | None:
        if values is None:
            return None
        if any(v < 0 for v in values) or len(set(values)) != len(values):
            raise ValueError(f"seeds {values} must be distinct non-negative integers")
        return values

    @model_validator(mode="after")
    def _seed_not_overridden(self) -> Entry:
        if self.seeds is not None and any(o.replace(" ", "").startswith("seed=") for o in self.overrides):
            raise ValueError("give the seed either in seeds or as a 'seed=' override, not both")
        return self


class Claim(Strict):
    id: str
    claim: str
    source: str
    metrics: list[str] = Field(default_factory=lambda: list(DEFAULT_CLAIM_METRICS), min_length=1)
    at: list[float] = Field(default_factory=lambda: [20.0], min_length=1)
    checks: list[str] = Field(min_length=1)
    also: list[str] = Field(default_factory=list)
    """Comparisons reported beside the verdict without deciding it (a gap the paper ranks otherwise)."""
    cause: str | None = Field(None, min_length=1)
    """Why the claim does not hold here, as measured (shown when the verdict is not "holds")."""
    note: str | None = Field(None, min_length=1)
    """Anything a reader of the verdict needs (how the check maps to the paper's table)."""

    @field_validator("checks", "also")
    @classmethod
    def _checks(cls, checks: list[str]) -> list[str]:
        for check in checks:
            parse_check(check)
        return checks


class Quick(Strict):
    settings: dict[str, Any] = Field(default_factory=dict)
    grid: list[Entry] = Field(min_length=1)


class GridFile(Strict):
    settings: Settings = Field(default_factory=Settings)
    grid: list[Entry] = Field(min_length=1)
    quick: Quick
    claims_from: str | None = Field(None, min_length=1)
    """Another grid file (relative to this one) whose claims come first; resolved by :func:`load_grid`."""
    claims: list[Claim] = Field(default_factory=list)


@dataclass(frozen=True)
class Job:
    id: str
    recipe: str
    ratio: float
    recovery: bool
    overrides: tuple[str, ...] = ()
    label: str | None = None
    """The row's name when it is not the recipe's (see :class:`Entry`)."""
    seed: int | None = None
    """The seed of one draw of a seeded row (its overrides end with ``seed=N``); None: not seeded."""
    zeroshot: bool = True
    """False: evaluated without zero-shot (:attr:`Entry.zeroshot`)."""

    @property
    def name(self) -> str:
        return self.label or self.recipe

    @property
    def group(self) -> str:
        """The row the claims name: the id without ``:seedN``."""
        return self.id if self.seed is None else self.id.removesuffix(seed_suffix(self.seed))


def pct(ratio: float) -> str:
    """``0.2 -> "20"``, ``0.125 -> "12.5"``."""
    return f"{round(ratio * 100, 6):g}"


def row_id(recipe: str, ratio: float, recovery: bool) -> str:
    return f"{recipe}@{pct(ratio)}{'+ft' if recovery else ''}"


def seed_suffix(seed: int) -> str:
    return f":seed{seed}"


def read_grid_yaml(path: Path) -> Any:
    """The parsed YAML of a grid file, read with the recipes' bounds (:func:`benchmarks.core.inputs.read_yaml_file`);
    :class:`BenchError` (one line, with the line and column) when unreadable."""
    return read_yaml_file(Path(path), "grid file")


MAX_CLAIMS_FROM = 8
"""How many grid files a chain of ``claims_from`` may pass through."""


def load_grid(path: Path = GRID_FILE, _chain: tuple[Path, ...] = ()) -> GridFile:
    """The grid file ``path`` validated, with the claims of the files its ``claims_from`` names (a chain of at most
    :data:`MAX_CLAIMS_FROM` files, no file twice: a cycle is one line)."""
    data = read_grid_yaml(path)
    try:
        grid = GridFile.model_validate(data)
    except ValidationError as error:
        raise BenchError(f"{path}: {format_validation_error(error)}") from None
    if grid.claims_from is not None:
        source = Path(path).parent / grid.claims_from
        if source.resolve() == Path(path).resolve():
            raise BenchError(f"{path}: claims_from names the file itself")
        chain = (*_chain, Path(path).resolve())
        if source.resolve() in chain:
            cycle = " -> ".join(str(p) for p in (*chain[chain.index(source.resolve()) :], source.resolve()))
            raise BenchError(
                f"{path}: claims_from makes a cycle ({cycle}); name a grid file that holds the claims itself"
            )
        if len(chain) >= MAX_CLAIMS_FROM:
            raise BenchError(
                f"{path}: claims_from chains more than {MAX_CLAIMS_FROM} grid files; name the source directly"
            )
        inherited = load_grid(source, chain).claims
        ids = [c.id for c in inherited + grid.claims]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise BenchError(f"{path}: claim id {', '.join(twice)} both here and in claims_from {grid.claims_from}")
        grid = grid.model_copy(update={"claims": inherited + grid.claims})
    return grid


def resolve_settings(grid: GridFile, quick: bool, cli: dict[str, Any]) -> Settings:
    """The grid's settings, then the quick section's (with ``quick``), then the command line's."""
    merged = grid.settings.model_dump()
    updates = [grid.quick.settings] if quick else []
    updates.append({k: v for k, v in cli.items() if v is not None})
    for update in updates:
        for key, value in update.items():
            if key == "speed" and isinstance(value, dict):
                merged["speed"] = {**merged["speed"], **value}
            else:
                merged[key] = value
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as error:
        raise BenchError(f"settings: {format_validation_error(error)}") from None
    settings.check()
    return settings


def parse_ratios(text: str) -> list[float]:
    """``"0.1,0.2"`` or ``"10,20"`` (percent when above 1)."""
    ratios = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            value = float(item)
        except ValueError:
            raise BenchError(
                f"--ratios: '{item}' is not a number (give fractions like 0.2 or percents like 20)"
            ) from None
        value = value / 100 if value >= 1 else value
        if not 0.0 < value < 1.0:
            raise BenchError(f"--ratios: {item} is not a ratio in (0, 1) or a percentage in [1, 100)")
        ratios.append(value)
    if not ratios:
        raise BenchError("--ratios: no ratio given")
    return ratios


def _same(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


def select_entries(entries: list[Entry], only: list[str] | None) -> list[Entry]:
    """The entries named in ``only`` (all when None); a bundled recipe outside the grid is added with
    the defaults; a name that is neither is an error. ``dense`` is always run and may be named."""
    if not only:
        return list(entries)
    from slimkit.recipes.loading import bundled_recipes

    names = [n for n in dict.fromkeys(only) if n != DENSE]
    known = {e.recipe for e in entries} | {e.label for e in entries if e.label}
    unknown = [n for n in names if n not in known and n not in bundled_recipes() and not Path(n).is_file()]
    if unknown:
        raise BenchError(
            f"--only: unknown recipe {', '.join(repr(n) for n in unknown)}; in this grid: "
            f"{', '.join(dict.fromkeys(e.recipe for e in entries))} (or any bundled recipe or recipe file)"
        )
    selected = [e for e in entries if e.recipe in names or e.label in names]
    selected += [Entry(recipe=n) for n in names if n not in known]
    return selected


def expand(entries: list[Entry], settings: Settings, ratios: list[float] | None = None) -> list[Job]:
    """One job per entry x ratio x recovery setting (x seed, for an entry with ``seeds``). ``ratios``
    (from ``--ratios``) replaces the settings' ratios and narrows an entry's own list to the ratios in
    both."""
    jobs: list[Job] = []
    for entry in entries:
        if entry.ratios is None:
            chosen = ratios or settings.ratios
        else:
            chosen = [r for r in entry.ratios if ratios is None or any(_same(r, x) for x in ratios)]
        for ratio in chosen:
            for recovery in entry.recovery:
                name = entry.label or entry.recipe
                overrides = tuple(entry.overrides)
                row = row_id(name, ratio, recovery)
                if entry.seeds is None:
                    jobs.append(
                        Job(row, entry.recipe, ratio, recovery, overrides, entry.label, zeroshot=entry.zeroshot)
                    )
                    continue
                for seed in entry.seeds:
                    job_id = row + seed_suffix(seed)
                    seeded = (*overrides, f"seed={seed}")
                    jobs.append(Job(job_id, entry.recipe, ratio, recovery, seeded, entry.label, seed, entry.zeroshot))
    seen: set[str] = set()
    for job in jobs:
        if job.id in seen:
            raise BenchError(f"row {job.id} appears twice in the grid")
        seen.add(job.id)
    clash = sorted({j.group for j in jobs if j.seed is not None} & {j.id for j in jobs if j.seed is None})
    if clash:
        raise BenchError(f"row {clash[0]} appears twice in the grid (once with seeds, once without)")
    return jobs
