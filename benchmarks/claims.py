"""Paper claims decided from the benchmark's numbers: "holds", "does not hold" or "not run".

A claim (declared in ``benchmarks/grid.yaml``) has checks like ``"cce@{r} < 0.75 * cce-random@{r}"``:
row ``A``, an operator (``<``, ``<=``, ``>``, ``>=``), an optional factor ``F`` and row ``B``; it
holds for a metric when ``value(A) OP F x value(B)``. ``{r}`` is replaced by each percentage in the
claim's ``at`` list, and every check is evaluated for every metric in ``metrics``.

Verdict: a ratio counts as run when every row the checks name at that ratio finished and has a
finite value of every metric. "not run" when no ratio was run (the evidence says which rows are
missing and why); "holds" when every comparison at every run ratio holds; otherwise "does not hold".
Ratios that were not run are named in the evidence, never guessed.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any

HOLDS, FAILS, NOT_RUN = "holds", "does not hold", "not run"

_CHECK = re.compile(
    r"^\s*(?P<a>[^\s<>=*]+)\s*(?P<op><=|>=|<|>)\s*(?:(?P<factor>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*\*\s*)?"
    r"(?P<b>[^\s<>=*]+)\s*$"
)
_ABSENT = " not in this run"
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@dataclass(frozen=True)
class Check:
    a: str
    op: str
    factor: float
    b: str

    def at(self, percent: str) -> Check:
        return Check(self.a.replace("{r}", percent), self.op, self.factor, self.b.replace("{r}", percent))

    def text(self) -> str:
        factor = "" if self.factor == 1.0 else f"{self.factor:g} * "
        return f"{self.a} {self.op} {factor}{self.b}"


def parse_check(text: str) -> Check:
    match = _CHECK.match(text)
    if match is None:
        raise ValueError(f"check '{text}' is not of the form 'ROW < [FACTOR *] ROW' (operators < <= > >=)")
    factor = float(match["factor"]) if match["factor"] else 1.0
    return Check(match["a"], match["op"], factor, match["b"])


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _value(rows: dict[str, dict[str, Any]], row: str, metric: str) -> tuple[float | None, str | None]:
    """``(value, None)`` or ``(None, why it is missing)``."""
    found = rows.get(row)
    if found is None:
        return None, f"{row}{_ABSENT}"
    if found.get("status") != "ok":
        reason = found.get("reason") or found.get("status")
        return None, f"{row} {found.get('status')}: {reason}"
    value = (found.get("metrics") or {}).get(metric)
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None, f"{row} has no finite {metric}"
    return float(value), None


def evaluate_claim(claim: Any, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``claim`` has ``id, claim, source, metrics, at, checks`` (a :class:`benchmarks.grid.Claim`)."""
    checks = [parse_check(c) for c in claim.checks]
    evidence: list[str] = []
    missing: list[str] = []
    run_ratios: list[str] = []
    failed = False
    for percent in (f"{p:g}" for p in claim.at):
        comparisons = []
        why_not: list[str] = []
        for check in (c.at(percent) for c in checks):
            for metric in claim.metrics:
                a, why_a = _value(rows, check.a, metric)
                b, why_b = _value(rows, check.b, metric)
                why_not += [w for w in (why_a, why_b) if w]
                if a is not None and b is not None:
                    comparisons.append((check, metric, a, b))
        if why_not:
            absent = [w.removesuffix(_ABSENT) for w in dict.fromkeys(why_not) if w.endswith(_ABSENT)]
            present = [w for w in dict.fromkeys(why_not) if not w.endswith(_ABSENT)]
            parts = present + ([f"not in this run: {', '.join(absent)}"] if absent else [])
            missing.append(f"{percent}%: " + "; ".join(parts))
            continue
        run_ratios.append(percent)
        for check, metric, a, b in comparisons:
            ok = _OPS[check.op](a, check.factor * b)
            failed |= not ok
            factor = "" if check.factor == 1.0 else f"{check.factor:g} x "
            evidence.append(
                f"{metric}: {check.a} {_fmt(a)} {check.op} {factor}{check.b} {_fmt(b)}: {'yes' if ok else 'no'}"
            )
    if not run_ratios:
        verdict = NOT_RUN
    else:
        verdict = FAILS if failed else HOLDS
    return {
        "id": claim.id,
        "claim": claim.claim,
        "source": claim.source,
        "checks": list(claim.checks),
        "metrics": list(claim.metrics),
        "verdict": verdict,
        "ratios_run": run_ratios,
        "evidence": evidence,
        "not_run": missing,
    }


def evaluate_claims(claims: list[Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_id = {row["id"]: row for row in rows}
    return [evaluate_claim(claim, by_id) for claim in claims]
