"""Paper claims decided from the benchmark's numbers, with the seeds' spread: "holds", "does not hold",
"within noise" or "not run".

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

from benchmarks.seeds import decision_rows, values_of

HOLDS, FAILS, NOISE, NOT_RUN = "holds", "does not hold", "within noise", "not run"

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


def _values(rows: dict[str, dict[str, Any]], row: str, metric: str) -> tuple[list[float] | None, str | None]:
    """``(draws, None)`` or ``(None, why they are missing)``."""
    found = rows.get(row)
    if found is None:
        return None, f"{row}{_ABSENT}"
    if found.get("status") != "ok":
        reason = found.get("reason") or found.get("status")
        return None, f"{row} {found.get('status')}: {reason}"
    values = values_of(found, metric)
    if values is None:
        return None, f"{row} has no finite {metric}"
    return values, None


def compare(op: str, a: list[float], factor: float, b: list[float]) -> tuple[str, int]:
    """The verdict of ``a OP factor x b`` over every pairing of draws, and how many pairings hold."""
    held = sum(_OPS[op](x, factor * y) for x in a for y in b)
    total = len(a) * len(b)
    return (HOLDS if held == total else FAILS if held == 0 else NOISE), held


def describe(row: str, values: list[float]) -> str:
    """``lorap@20 81.1 (1 draw)`` or ``lorap@20 81.1 [80.9-81.4; 3 seeds]`` (the mean, then min-max)."""
    if len(values) == 1:
        return f"{row} {_fmt(values[0])} (1 draw)"
    mean = sum(values) / len(values)
    return f"{row} {_fmt(mean)} [{_fmt(min(values))}-{_fmt(max(values))}; {len(values)} seeds]"


def _comparison_text(check: Check, metric: str, a: list[float], b: list[float]) -> tuple[str, str]:
    verdict, held = compare(check.op, a, check.factor, b)
    factor = "" if check.factor == 1.0 else f"{check.factor:g} x "
    pairings = len(a) * len(b)
    outcome = {HOLDS: "yes", FAILS: "no"}.get(verdict, f"within noise ({held} of {pairings} pairings hold)")
    if verdict != NOISE and pairings > 1:
        outcome += f" (all {pairings} pairings)"
    return verdict, f"{metric}: {describe(check.a, a)} {check.op} {factor}{describe(check.b, b)}: {outcome}"


def _at_ratio(
    checks: list[Check], metrics: list[str], rows: dict[str, dict[str, Any]], percent: str
) -> tuple[list[tuple[Check, str, list[float], list[float]]], list[str]]:
    comparisons, why_not = [], []
    for check in (c.at(percent) for c in checks):
        for metric in metrics:
            a, why_a = _values(rows, check.a, metric)
            b, why_b = _values(rows, check.b, metric)
            why_not += [w for w in (why_a, why_b) if w]
            if a is not None and b is not None:
                comparisons.append((check, metric, a, b))
    return comparisons, why_not


def _missing_text(percent: str, why_not: list[str]) -> str:
    absent = [w.removesuffix(_ABSENT) for w in dict.fromkeys(why_not) if w.endswith(_ABSENT)]
    present = [w for w in dict.fromkeys(why_not) if not w.endswith(_ABSENT)]
    parts = present + ([f"not in this run: {', '.join(absent)}"] if absent else [])
    return f"{percent}%: " + "; ".join(parts)


def evaluate_claim(claim: Any, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``claim`` has ``id, claim, source, metrics, at, checks`` and optionally ``also, cause, note`` (a
    :class:`benchmarks.grid.Claim`); ``rows`` by id, seeded rows as their aggregates."""
    checks = [parse_check(c) for c in claim.checks]
    also = [parse_check(c) for c in getattr(claim, "also", None) or []]
    evidence: list[str] = []
    missing: list[str] = []
    run_ratios: list[str] = []
    verdicts: list[str] = []
    for percent in (f"{p:g}" for p in claim.at):
        comparisons, why_not = _at_ratio(checks, claim.metrics, rows, percent)
        if why_not:
            missing.append(_missing_text(percent, why_not))
            continue
        run_ratios.append(percent)
        for check, metric, a, b in comparisons:
            verdict, text = _comparison_text(check, metric, a, b)
            verdicts.append(verdict)
            evidence.append(text)
        extra, _why = _at_ratio(also, claim.metrics, rows, percent)
        evidence += [f"(not deciding) {_comparison_text(*c)[1]}" for c in extra]
    if not run_ratios:
        verdict = NOT_RUN
    else:
        verdict = FAILS if FAILS in verdicts else NOISE if NOISE in verdicts else HOLDS
    return {
        "id": claim.id,
        "claim": claim.claim,
        "source": claim.source,
        "checks": list(claim.checks),
        "also": [c.text() for c in also],
        "metrics": list(claim.metrics),
        "verdict": verdict,
        "cause": getattr(claim, "cause", None),
        "note": getattr(claim, "note", None),
        "ratios_run": run_ratios,
        "evidence": evidence,
        "not_run": missing,
    }


def evaluate_claims(claims: list[Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every claim decided on ``rows`` (measured rows; seeded draws are aggregated here)."""
    by_id = {row["id"]: row for row in decision_rows(rows)}
    return [evaluate_claim(claim, by_id) for claim in claims]
