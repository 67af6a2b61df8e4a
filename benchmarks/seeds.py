"""Seeded rows: several compressions of one row, reported as their mean with the spread.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, cast

NORM_MEAN = "zeroshot_mean_acc_norm"
_SIZE_FIELDS = ("of", "params", "macs", "layers", "structure", "achieved", "target_met", "recipe_source")


def add_norm_mean(metrics: dict[str, Any]) -> None:
    """``metrics[NORM_MEAN]`` from the per-task ``TASK_acc`` / ``TASK_acc_norm`` in ``metrics`` (in place).
    Tasks are the ones with a ``TASK_acc``; nothing is added when there are none."""
    tasks = [k.removesuffix("_acc") for k in metrics if k.endswith("_acc") and not k.startswith("zeroshot_")]
    values = [metrics.get(f"{t}_acc_norm", metrics[f"{t}_acc"]) for t in tasks]
    values = [v for v in values if isinstance(v, int | float)]
    if values and len(values) == len(tasks):
        metrics[NORM_MEAN] = sum(values) / len(values)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _draws(members: list[dict[str, Any]], part: str, key: str) -> list[float] | None:
    """``member[part][key]`` of every member, or None unless every one is a finite number."""
    values = [(m.get(part) or {}).get(key) for m in members]
    return cast(list[float], values) if all(_finite(v) for v in values) else None


def aggregate(group: str, members: list[dict[str, Any]]) -> dict[str, Any]:
    """The row ``group`` from its seeds' rows ``members`` (see the module docstring)."""
    first = members[0]
    seeds = [m.get("seed") for m in members]
    ok = [m for m in members if m.get("status") == "ok"]
    missing = {str(m.get("seed")): f"{m.get('status')}: {m.get('reason')}" for m in members if m not in ok}
    row: dict[str, Any] = {
        "id": group,
        "recipe": first.get("recipe"),
        "ratio": first.get("ratio"),
        "recovery": first.get("recovery"),
        "seeds": seeds,
        "seeds_ok": [m.get("seed") for m in ok],
        "seeds_missing": missing,
        "draws": len(ok),
        "seed_rows": [m["id"] for m in ok],
    }
    if not ok:
        reasons = "; ".join(f"seed {s}: {r}" for s, r in missing.items())
        return {**row, "status": first.get("status", "failed"), "reason": reasons}
    row.update({k: ok[0][k] for k in _SIZE_FIELDS if k in ok[0]})
    row["status"] = "ok"
    metrics: dict[str, float] = {}
    spread: dict[str, dict[str, Any]] = {}
    names = dict.fromkeys(k for m in ok for k in (m.get("metrics") or {}))
    for name in names:
        values = _draws(ok, "metrics", name)
        if values is not None:
            metrics[name] = statistics.fmean(values)
            spread[name] = {"min": min(values), "max": max(values), "values": values}
    row["metrics"], row["spread"] = metrics, spread
    removed = _draws(ok, "params", "removed_ratio")
    if removed is not None:
        row["params"] = {**(row.get("params") or {}), "removed_ratio": statistics.fmean(removed)}
    speed = {}
    for key in ("prefill_ratio", "decode_ratio"):
        values = _draws(ok, "speed", key)
        if values is not None:
            speed[key] = statistics.fmean(values)
    row["speed"] = speed
    compress, peak = _draws(ok, "cost", "compress_s"), _draws(ok, "cost", "peak_rss_mb")
    row["cost"] = {
        "compress_s": statistics.fmean(compress) if compress is not None else None,
        "peak_rss_mb": max(peak) if peak is not None else None,
    }
    return row


def seed_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The aggregate of every seeded row in ``rows``, in the order their first seed appears."""
    members: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("seed_of"):
            members.setdefault(row["seed_of"], []).append(row)
    return [aggregate(group, found) for group, found in members.items()]


def decision_rows(rows: list[dict[str, Any]], groups: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``rows`` with each seeded row's draws replaced by its aggregate (at the first draw's place): the
    rows claims are decided on and quality is tabled from. ``groups`` defaults to :func:`seed_groups`."""
    by_id = {g["id"]: g for g in (seed_groups(rows) if groups is None else groups)}
    out: list[dict[str, Any]] = []
    placed: set[str] = set()
    for row in rows:
        group = row.get("seed_of")
        if not group:
            out.append(row)
        elif group not in placed and group in by_id:
            out.append(by_id[group])
            placed.add(group)
    return out


def draws_of(row: dict[str, Any]) -> int:
    """How many compressions a row's numbers come from (1 for a row without seeds)."""
    return int(row.get("draws", 1))


def values_of(row: dict[str, Any], metric: str) -> list[float] | None:
    """The individual draws of ``metric`` (one value for a single-draw row); None if not finite."""
    spread = (row.get("spread") or {}).get(metric)
    if spread is not None:
        return [float(v) for v in spread["values"]]
    value = (row.get("metrics") or {}).get(metric)
    return [float(value)] if value is not None and _finite(value) else None
