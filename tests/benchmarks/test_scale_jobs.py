"""benchmarks.scale_jobs: expected peaks, admission beside running rows, the re-run rule, the simulated schedule."""

from __future__ import annotations

import math

import pytest

from benchmarks.scale_jobs import (
    GIB,
    Demand,
    blocked_by,
    can_start,
    expected_peak,
    rerun_alone,
    short_of_memory,
    simulate,
)


def test_expected_peak_takes_the_larger_of_plan_and_measurement_with_the_margin():
    assert expected_peak(10 * GIB, None) == pytest.approx(13 * GIB)  # 10 x 1.2 + 1
    assert expected_peak(10 * GIB, 20 * GIB) == pytest.approx(25 * GIB)  # a measured 20 beats the plan's 10
    assert expected_peak(None, 5 * GIB) == pytest.approx(7 * GIB)
    assert expected_peak(None, None) == math.inf  # nothing known: it runs alone
    # a plan above the whole device is refused before loading: only the process, no need to run alone
    assert expected_peak(150 * GIB, None, device=140 * GIB) == GIB


def test_a_row_starts_when_its_peak_fits_beside_the_running_ones():
    running = [Demand(40 * GIB), Demand(40 * GIB)]
    assert can_start(Demand(20 * GIB), running, 100 * GIB, math.inf, 3)  # 40 + 40 + 20 = 100: fits
    assert not can_start(Demand(21 * GIB), running, 100 * GIB, math.inf, 3)
    assert not can_start(Demand(1 * GIB), running, 100 * GIB, math.inf, 2)  # --jobs 2: two already run
    assert can_start(Demand(math.inf), [], 100 * GIB, 0.0, 1)  # nothing runs: any row starts, alone
    assert not can_start(Demand(1 * GIB), [Demand(math.inf)], 100 * GIB, math.inf, 4)  # nothing beside it
    # the scratch disk: each row may write its saved model
    assert not can_start(Demand(1, disk=30 * GIB), [Demand(1, disk=30 * GIB)], 100 * GIB, 50 * GIB, 4)
    assert can_start(Demand(1, disk=20 * GIB), [Demand(1, disk=30 * GIB)], 100 * GIB, 50 * GIB, 4)
    # why a row waits (logged)
    assert (
        blocked_by(Demand(21 * GIB), running, 100 * GIB, math.inf, 3) == "memory: 80.0 expected beside 21.0 > 100.0 GiB"
    )
    assert blocked_by(Demand(1), running, 100 * GIB, math.inf, 2) == "2 rows run (--jobs 2)"
    disk = blocked_by(Demand(1, disk=30 * GIB), [Demand(1, disk=30 * GIB)], 100 * GIB, 50 * GIB, 4)
    assert disk == "scratch disk: 30.0 beside 30.0 > 50.0 GiB free"


def test_the_simulated_schedule_keeps_the_order():
    gib = [Demand(g * GIB) for g in (60, 50, 30, 20)]
    # 60 runs; 50 waits for it (110 > 100); at t=10 50, 30 and 20 start together (100 <= 100)
    assert simulate(gib, [10, 10, 10, 10], 100 * GIB, 3) == [0, 10, 10, 10]
    # no overtaking: 10 would fit beside 60 at t=0, but 50 waits ahead of it (the order is the budget's)
    assert simulate([Demand(g * GIB) for g in (60, 50, 10)], [10, 5, 5], 100 * GIB, 3) == [0, 10, 10]
    # --jobs 1: one after the other
    assert simulate([Demand(GIB)] * 3, [4, 5, 6], 100 * GIB, 1) == [0, 4, 9]


def test_a_row_short_of_memory_beside_others_runs_again_alone_once():
    oom = {"status": "oom", "reason": "exit 1: torch.OutOfMemoryError: CUDA out of memory", "beside": ["x/cce"]}
    assert short_of_memory(oom) and rerun_alone(oom)
    assert not rerun_alone(oom | {"beside": []})  # it ran alone: out of memory is its result
    assert not rerun_alone(oom | {"rerun_of": {"status": "oom"}})  # once
    refused = "exit 2: error: cce needs about 41.0 GiB on cuda (weights 15.0, activations 26.0) and cuda has 30.2 GiB"
    assert rerun_alone({"status": "failed", "reason": refused, "beside": ["x/lorap"]})
    assert not rerun_alone({"status": "failed", "reason": "exit 1: KeyError: 'q_proj'", "beside": ["x/lorap"]})
    assert not rerun_alone({"status": "timeout", "reason": "not finished", "beside": ["x/lorap"]})
    # refused by a plan above the device: alone it would be refused the same
    big = {"status": "failed", "reason": refused, "beside": ["x/lorap"], "planned_peak_mb": 150 * 1024}
    assert not rerun_alone(big, device=140 * GIB) and rerun_alone(big, device=160 * GIB)
