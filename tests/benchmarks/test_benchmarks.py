"""benchmarks/: the grid file, claims evaluator, tables and plots on synthetic rows (fast), the command
line's one-line errors, and (marked ``real``) a smoke run of the quick grid on smollm2-135m."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from benchmarks.claims import FAILS, HOLDS, NOISE, NOT_RUN, compare, evaluate_claims, parse_check
from benchmarks.core.errors import BenchError
from benchmarks.core.processes import via_launcher
from benchmarks.grid import (
    Claim,
    Entry,
    Settings,
    expand,
    load_grid,
    parse_ratios,
    resolve_settings,
    row_id,
    select_entries,
)
from benchmarks.grid_plots import plot_quality, plot_widths
from benchmarks.grid_rows import Bench
from benchmarks.model_counts import finite_numbers, lowrank_params, residual_params_in_model
from benchmarks.speed import measure
from benchmarks.tables import markdown

ROOT = Path(__file__).resolve().parents[2]


def _row(row_id, recipe, ratio=0.2, recovery=False, status="ok", **metrics):
    return {
        "id": row_id,
        "recipe": recipe,
        "ratio": ratio,
        "of": "model",
        "recovery": recovery,
        "status": status,
        "metrics": metrics,
        "params": {"before": 100, "after": 80, "removed_ratio": 0.2},
        "macs": {"before": 1000, "after": 800, "seq_len": 128},
        "layers": {
            "widths": [
                {"num_attention_heads": 6, "intermediate_size": 96},
                {"num_attention_heads": 9, "intermediate_size": 80},
            ],
            "params": [70, 90],
            "dense_params": [100, 100],
        },
    }


def _claim(checks, metrics=("wikitext2_ppl",), at=(20,), **extra):
    return Claim(
        id="c", claim="a beats b", source="paper", checks=list(checks), metrics=list(metrics), at=list(at), **extra
    )


def _seeded(group, recipe, values, metric="wikitext2_ppl", ratio=0.2, seeds=None):
    """One measured row per seed of ``group`` (what run_job writes for a seeded entry)."""
    rows = []
    for seed, value in zip(seeds or range(len(values)), values, strict=True):
        row = _row(f"{group}:seed{seed}", recipe, ratio, **{metric: value})
        row.update(seed=seed, seed_of=group)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- claims


def test_parse_check_reads_rows_operator_and_factor():
    check = parse_check("cce@{r} < 0.75 * cce-random@{r}")
    assert (check.a, check.op, check.factor, check.b) == ("cce@{r}", "<", 0.75, "cce-random@{r}")
    assert parse_check("llm-pruner+sp3@20+ft>=llm-pruner@20+ft").factor == 1.0
    assert parse_check("a@20 <= 1e-1 * b@20").factor == pytest.approx(0.1)
    for bad in ("a@20", "a@20 == b@20", "a@20 < b@20 < c@20", "a@20 < x * b@20"):
        with pytest.raises(ValueError):
            parse_check(bad)


def test_claims_hold_fail_and_not_run_from_the_numbers():
    rows = [
        _row("a@20", "a", wikitext2_ppl=10.0, ptb_ppl=20.0, zeroshot_mean_acc=0.5),
        _row("b@20", "b", wikitext2_ppl=14.0, ptb_ppl=19.0, zeroshot_mean_acc=0.4),
        _row("c@20", "c", status="not run"),
        _row("d@20", "d", wikitext2_ppl=float("nan")),
    ]
    rows[2]["reason"] = "recipe 'c' does not exist (yet)"
    [holds, wide, both, acc, missing, failed, nan] = evaluate_claims(
        [
            _claim(["a@{r} < b@{r}"]),
            _claim(["a@{r} < 0.75 * b@{r}"]),  # 10 < 10.5 holds; with ptb it would not
            _claim(["a@{r} < b@{r}"], metrics=("wikitext2_ppl", "ptb_ppl")),  # ptb 20 > 19
            _claim(["a@{r} > b@{r}"], metrics=("zeroshot_mean_acc",)),
            _claim(["a@{r} < e@{r}"]),
            _claim(["a@{r} < c@{r}"]),
            _claim(["a@{r} < d@{r}"]),
        ],
        rows,
    )
    assert holds["verdict"] == HOLDS and holds["evidence"] == [
        "wikitext2_ppl: a@20 10 (1 draw) < b@20 14 (1 draw): yes"
    ]
    assert wide["verdict"] == HOLDS and "0.75 x b@20" in wide["evidence"][0]
    assert both["verdict"] == FAILS and both["evidence"][1].endswith(": no")
    assert acc["verdict"] == HOLDS
    assert missing["verdict"] == NOT_RUN and "not in this run: e@20" in missing["not_run"][0]
    assert failed["verdict"] == NOT_RUN and "does not exist (yet)" in failed["not_run"][0]
    assert nan["verdict"] == NOT_RUN and "no finite wikitext2_ppl" in nan["not_run"][0]


def test_claim_over_several_ratios_uses_the_ratios_that_ran():
    rows = [_row("a@10", "a", 0.1, wikitext2_ppl=5.0), _row("b@10", "b", 0.1, wikitext2_ppl=6.0)]
    rows += [_row("a@20", "a", wikitext2_ppl=9.0), _row("b@20", "b", wikitext2_ppl=8.0)]
    [result] = evaluate_claims([_claim(["a@{r} < b@{r}"], at=(10, 20, 30))], rows)
    assert result["verdict"] == FAILS and result["ratios_run"] == ["10", "20"]
    assert result["not_run"] == ["30%: not in this run: a@30, b@30"]
    [only_10] = evaluate_claims([_claim(["a@{r} < b@{r}"], at=(10, 30))], rows)
    assert only_10["verdict"] == HOLDS


def test_claims_recovery_rows_by_id():
    rows = [_row("x@20+ft", "x", recovery=True, wikitext2_ppl=3.0), _row("x@20", "x", wikitext2_ppl=4.0)]
    [result] = evaluate_claims([_claim(["x@{r}+ft < x@{r}"])], rows)
    assert result["verdict"] == HOLDS


def test_compare_pairs_every_draw():
    """holds: A's worst draw beats B's best; does not hold: the reverse separation; else within noise."""
    assert compare("<", [10, 11, 12], 1.0, [13, 14, 15]) == (HOLDS, 9)
    assert compare("<", [13, 14, 15], 1.0, [10, 11, 12]) == (FAILS, 0)
    assert compare("<", [10, 11, 12], 1.0, [11.5, 14, 15]) == (NOISE, 8)  # 12 < 11.5 fails
    assert compare("<", [10, 11, 12], 0.75, [14, 20, 21]) == (NOISE, 7)  # 11, 12 < 0.75 x 14 fail
    assert compare(">", [0.41], 1.0, [0.40, 0.42]) == (NOISE, 1)  # a single draw against a spread
    assert compare("<=", [5.0], 1.0, [5.0]) == (HOLDS, 1)  # two single draws: one pairing, never noise
    assert compare("<", [5.0], 1.0, [5.0]) == (FAILS, 0)


def test_seeded_rows_aggregate_to_mean_and_spread():
    from benchmarks.seeds import aggregate, decision_rows, seed_groups

    rows = _seeded("x@20", "x", [10.0, 12.0, 14.0])
    rows[0]["metrics"]["piqa_acc"] = 0.5  # a metric only one seed has is left out of the mean
    rows[1]["cost"] = rows[2]["cost"] = {"compress_s": 10.0, "peak_rss_mb": 900.0}
    rows[0]["cost"] = {"compress_s": 40.0, "peak_rss_mb": 1200.0}
    [group] = seed_groups(rows)
    assert group["id"] == "x@20" and group["status"] == "ok" and group["draws"] == 3 and group["seeds"] == [0, 1, 2]
    assert group["metrics"] == {"wikitext2_ppl": 12.0}
    assert group["spread"]["wikitext2_ppl"] == {"min": 10.0, "max": 14.0, "values": [10.0, 12.0, 14.0]}
    assert group["cost"] == {"compress_s": 20.0, "peak_rss_mb": 1200.0}
    assert group["params"]["removed_ratio"] == pytest.approx(0.2) and group["of"] == "model"
    # a failed seed: the mean is over the seeds that finished, the missing one is named
    failed = {**rows[2], "status": "failed", "reason": "boom"}
    partial = aggregate("x@20", [rows[0], rows[1], failed])
    assert partial["draws"] == 2 and partial["metrics"]["wikitext2_ppl"] == 11.0
    assert partial["seeds_missing"] == {"2": "failed: boom"}
    none = aggregate("x@20", [{**r, "status": "failed", "reason": "oom"} for r in rows])
    assert none["status"] == "failed" and none["reason"].startswith("seed 0: failed: oom")
    # decision rows: the aggregate in place of the first seed, single-draw rows unchanged
    single = _row("y@20", "y", wikitext2_ppl=5.0)
    assert [r["id"] for r in decision_rows([single, *rows, _row("z@20", "z")])] == ["y@20", "x@20", "z@20"]


def test_claims_decided_with_the_spread():
    rows = _seeded("a@20", "a", [10.0, 11.0, 12.0]) + _seeded("b@20", "b", [13.0, 14.0, 15.0])
    rows += [*_seeded("c@20", "c", [9.0, 12.5, 16.0]), _row("d@20", "d", wikitext2_ppl=11.5)]
    rows += [_row("e@20", "e", wikitext2_ppl=30.0)]
    claims = [
        _claim(["a@{r} < b@{r}"]),
        _claim(["b@{r} < a@{r}"], cause="b drops the wrong heads", note="paper: Table 1"),
        _claim(["a@{r} < c@{r}"], cause="measured cause"),
        _claim(["a@{r} < d@{r}"]),  # a single draw inside a's spread
        _claim(["a@{r} < b@{r}", "a@{r} < c@{r}"]),  # holds + within noise
        _claim(["a@{r} < c@{r}", "b@{r} < a@{r}"]),  # within noise + does not hold
        _claim(["a@{r} < e@{r}"], also=["e@{r} < a@{r}"]),
    ]
    holds, fails, noise, single, mixed, worst, also = evaluate_claims(claims, rows)
    assert holds["verdict"] == HOLDS
    assert holds["evidence"] == [
        "wikitext2_ppl: a@20 11 [10-12; 3 seeds] < b@20 14 [13-15; 3 seeds]: yes (all 9 pairings)"
    ]
    assert (
        fails["verdict"] == FAILS and fails["cause"] == "b drops the wrong heads" and fails["note"] == "paper: Table 1"
    )
    assert noise["verdict"] == NOISE and "within noise (6 of 9 pairings hold)" in noise["evidence"][0]
    assert single["verdict"] == NOISE and "d@20 11.5 (1 draw)" in single["evidence"][0]
    assert mixed["verdict"] == NOISE and worst["verdict"] == FAILS
    assert also["verdict"] == HOLDS and also["also"] == ["e@{r} < a@{r}"]
    assert (
        also["evidence"][1].startswith("(not deciding) wikitext2_ppl: e@20 30 (1 draw) < a@20")
        and "no" in also["evidence"][1]
    )


def test_zeroshot_mean_uses_acc_norm_where_defined():
    from benchmarks.seeds import NORM_MEAN, add_norm_mean

    metrics = {"piqa_acc": 0.60, "piqa_acc_norm": 0.70, "boolq_acc": 0.50, "zeroshot_mean_acc": 0.55}
    add_norm_mean(metrics)
    assert metrics[NORM_MEAN] == pytest.approx(0.60)  # (0.70 + 0.50) / 2
    empty = {"wikitext2_ppl": 30.0}
    add_norm_mean(empty)
    assert NORM_MEAN not in empty


# --------------------------------------------------------------------------------------------- grid


def claim_rows(grid) -> set[str]:
    """Every row id a grid's claims read (``recipe@PCT`` and ``recipe@PCT+ft`` at each ratio in ``at``)."""
    return {
        part.replace("{r}", f"{p:g}")
        for claim in grid.claims
        for check in claim.checks
        for part in (parse_check(check).a, parse_check(check).b)
        for p in claim.at
    }


def test_shipped_grid_file_is_valid_and_covers_the_recipes():
    grid = load_grid()
    recipes = {e.recipe for e in grid.grid}
    assert {"magnitude", "random", "wanda-channels", "llm-pruner", "cce", "cce-random", "cce-l2", "lorap"} <= recipes
    assert {"lorap-svd", "lorap-equal-split", "lorap-no-retain", "prunenet", "prunenet-random"} <= recipes
    assert {"prunenet-deterministic", "sp3-oneshot", "sp3-oneshot-identity", "sp3-llm", "llm-pruner+sp3"} <= recipes
    settings = resolve_settings(grid, quick=False, cli={})
    assert settings.ppl_window == 512 and len(settings.zeroshot_tasks) == 7
    jobs = expand(grid.grid, settings)
    ids = {j.id for j in jobs}
    assert {"llm-pruner@20", "llm-pruner@20+ft", "lorap@30+ft", "lorap-svd@20"} <= ids
    assert "lorap-svd@10" not in ids
    # every row a claim names is a row of the full grid
    assert claim_rows(grid) <= ids
    quick = resolve_settings(grid, quick=True, cli={"ppl_tokens": 1024, "speed": {"rounds": 2}})
    assert quick.ratios == [0.2] and quick.ppl_tokens == 1024 and quick.speed.rounds == 2
    assert all(not j.recovery for j in expand(grid.quick.grid, quick))


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("grid*.yaml")), ids=lambda p: p.name)
def test_every_grid_file_loads_names_bundled_recipes_and_rows_its_claims_read(path):
    from slimkit.recipes.loading import bundled_recipes

    recipes = set(bundled_recipes())
    if path.name == "grid-glue.yaml":  # benchmarks.glue_grid's own format (its loader checks claims name rows)
        from benchmarks.glue_rows import load_glue_grid

        rows = load_glue_grid(path).rows
        assert {row.recipe for row in rows} <= recipes
        # every sp3-bert row states its gates' start, so a change of the recipe's default does not change what a
        # row measured (its results files keep their meaning)
        assert all(any("rank_prior=" in o for o in r.overrides) for r in rows if r.recipe == "sp3-bert")
        return
    grid = load_grid(path)
    for entries in (grid.grid, grid.quick.grid):
        assert {e.recipe for e in entries} <= recipes
    if path.name == "grid.yaml" or path.name.startswith(("grid-claims", "grid-sp3")):
        # grid.yaml's claims are checked above; grid-claims*.yaml cover a part of its rows on purpose, and the
        # grid-sp3*.yaml files of 2026-11-22 carry a copy of that day's claims for rows they do not run.
        return
    ids = {j.id for j in expand(grid.grid, resolve_settings(grid, quick=False, cli={}))}
    assert claim_rows(grid) <= ids


def test_only_ratios_and_bad_input():
    entries = [Entry(recipe="lorap", recovery=[False, True]), Entry(recipe="lorap-svd", ratios=[0.2])]
    settings = Settings(ratios=[0.1, 0.2])
    assert [j.id for j in expand(entries, settings)] == [
        "lorap@10",
        "lorap@10+ft",
        "lorap@20",
        "lorap@20+ft",
        "lorap-svd@20",
    ]
    assert [j.id for j in expand(entries, settings, [0.3])] == ["lorap@30", "lorap@30+ft"]
    assert [j.id for j in expand(select_entries(entries, ["dense", "lorap-svd"]), settings)] == ["lorap-svd@20"]
    assert [e.recipe for e in select_entries(entries, ["magnitude"])] == ["magnitude"]  # bundled, not in grid
    with pytest.raises(BenchError, match="unknown recipe 'nope'"):
        select_entries(entries, ["nope"])
    assert parse_ratios("0.1, 20") == [0.1, 0.2]
    for bad in ("abc", "0", "150", ""):
        with pytest.raises(BenchError):
            parse_ratios(bad)
    with pytest.raises(BenchError, match="twice"):
        expand([Entry(recipe="a"), Entry(recipe="a")], settings)
    assert row_id("llm-pruner+sp3", 0.125, True) == "llm-pruner+sp3@12.5+ft"


def test_seeded_entries_one_job_per_seed_and_bad_seeds(tmp_path):
    settings = Settings(ratios=[0.2])
    jobs = expand([Entry(recipe="prunenet", seeds=[0, 1], zeroshot=False), Entry(recipe="lorap")], settings)
    assert [(j.id, j.group, j.seed, j.zeroshot) for j in jobs] == [
        ("prunenet@20:seed0", "prunenet@20", 0, False),
        ("prunenet@20:seed1", "prunenet@20", 1, False),
        ("lorap@20", "lorap@20", None, True),
    ]
    assert jobs[1].overrides == ("seed=1",)
    assert settings.for_job(jobs[0]).zeroshot_on is False and settings.for_job(jobs[2]) is settings
    with pytest.raises(BenchError, match="once with seeds, once without"):
        expand([Entry(recipe="a", seeds=[0]), Entry(recipe="a")], settings)
    for bad in ("seeds: [1, 1]", "seeds: [-1]", "seeds: [0], overrides: [seed=3]"):
        path = tmp_path / "grid.yaml"
        path.write_text(f"grid: [{{recipe: a, {bad}}}]\nquick: {{grid: [{{recipe: a}}]}}\n")
        with pytest.raises(BenchError, match=r"grid\.0"):
            load_grid(path)


def test_claims_grid_reuses_grid_claims_and_covers_their_rows(tmp_path):
    main, claims = load_grid(), load_grid(ROOT / "benchmarks" / "grid-claims.yaml")
    assert [c.id for c in claims.claims] == [c.id for c in main.claims]  # claims_from: one source
    settings = resolve_settings(claims, quick=False, cli={})
    assert settings.zeroshot_limit == 200 and settings.ppl_tokens == 16384
    jobs = expand(claims.grid, settings)
    rows = {j.group for j in jobs}
    zeroshot_rows = {j.group for j in jobs if j.zeroshot}
    for claim in claims.claims:
        named = {
            part.replace("{r}", f"{p:g}")
            for c in claim.checks
            for part in (parse_check(c).a, parse_check(c).b)
            for p in claim.at
        }
        assert named <= rows, (claim.id, named - rows)
        if any("zeroshot" in m for m in claim.metrics):
            assert named <= zeroshot_rows, (claim.id, named - zeroshot_rows)
    seeded = {j.group for j in jobs if j.seed is not None}
    assert {"cce-random@20", "lorap@20", "lorap-no-retain@20", "prunenet@30", "prunenet-deterministic@20"} <= seeded
    path = tmp_path / "g.yaml"
    path.write_text(
        "grid: [{recipe: a}]\nquick: {grid: [{recipe: a}]}\nclaims_from: "
        f"{ROOT / 'benchmarks' / 'grid.yaml'}\nclaims: [{{id: lorap-retain, claim: y, source: z, checks: ['a < b']}}]\n"
    )
    with pytest.raises(BenchError, match="claim id lorap-retain both here and in claims_from"):
        load_grid(path)


def test_plan_costs_rows_from_history_settings_and_kept_runs(tmp_path):
    from benchmarks.plan import DEFAULT_COMPRESS_S, eval_estimate, plan_rows, plan_text

    results = tmp_path / "results"
    results.mkdir()
    history_rows = [
        {"id": "x@20", "recipe": "x", "ratio": 0.2, "recovery": False, "cost": {"process_wall_s": 40.0}},
        {"id": "x@20", "recipe": "x", "ratio": 0.2, "recovery": False, "cost": {"process_wall_s": 60.0}},
        {"id": "x@10", "recipe": "x", "ratio": 0.1, "recovery": False, "cost": {"process_wall_s": 5.0, "reused": True}},
    ]
    (results / "old.json").write_text(json.dumps({"rows": history_rows}))
    settings = Settings(ratios=[0.1, 0.2], zeroshot_tasks=["piqa"], zeroshot_limit=200)
    jobs = expand([Entry(recipe="x", seeds=[0, 1]), Entry(recipe="y", ratios=[0.2], zeroshot=False)], settings)
    runs = tmp_path / "runs"
    (runs / "x-r20_seed1").mkdir(parents=True)
    (runs / "x-r20_seed1" / "report.json").write_text("{}")  # compressed, not measured: costs its evaluation
    rows = {r["id"]: r for r in plan_rows(settings, jobs, runs, results)}
    assert rows["x@20:seed0"]["compress_s"] == 50.0 and rows["x@20:seed0"]["source"] == "2 runs"
    assert rows["x@10:seed0"]["compress_s"] == 50.0 and rows["x@10:seed0"]["source"] == "other ratios"
    assert rows["x@20:seed1"]["compress_s"] == 0.0 and rows["x@20:seed1"]["source"] == "compressed in --keep"
    assert rows["y@20"]["compress_s"] == DEFAULT_COMPRESS_S and rows["y@20"]["source"] == "?"
    assert rows["y@20"]["eval_s"] == eval_estimate(settings.for_job(jobs[-1])) < rows["x@20:seed0"]["eval_s"]
    text = plan_text(settings, list(rows.values()))
    assert text[-1].startswith("total about") and "1 rows with no compression time" in text[-1]
    assert "(no zero-shot)" in next(line for line in text if "y@20" in line)


def test_labelled_entries_sweep_one_recipe():
    """A sweep runs one recipe under several names (the SP3 group-size grid)."""
    grid = load_grid(Path(__file__).parents[2] / "benchmarks" / "grid-sp3-gs.yaml")
    settings = resolve_settings(grid, quick=False, cli={})
    jobs = expand(grid.grid, settings)
    assert {j.recipe for j in jobs} == {"sp3-oneshot"}
    assert [j.id for j in jobs][:2] == ["sp3-oneshot-gs1@10", "sp3-oneshot-gs1@20"]
    assert jobs[0].name == "sp3-oneshot-gs1" and "stages.0.args.group_size=1" in jobs[0].overrides
    assert [e.label for e in select_entries(grid.grid, ["sp3-oneshot-gs2"])] == ["sp3-oneshot-gs2"]


def test_bad_grid_file_is_one_line(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text("grid: [{recipe: a, ratios: [1.5]}]\nquick: {grid: [{recipe: a}]}\n")
    with pytest.raises(BenchError, match=r"grid\.0\.ratios"):
        load_grid(path)
    path.write_text(
        "grid: [{recipe: a}]\nquick: {grid: [{recipe: a}]}\nclaims: [{id: x, claim: y, source: z, checks: ['a ~ b']}]\n"
    )
    with pytest.raises(BenchError, match="not of the form"):
        load_grid(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "error: unrecognized arguments: --bogus"),
        (["--only", "nope", "--list"], "error: --only: unknown recipe 'nope'"),
        (["--ratios", "x", "--list"], "error: --ratios: 'x' is not a number"),
        (["--ppl-tokens", "1", "--list"], "error: argument --ppl-tokens: must be at least 2, got 1"),
        (["--zeroshot-tasks", "squad", "--list"], "unknown zero-shot task 'squad'"),
        (["--ppl-tokens", "100", "--list"], "below one window of 512"),
        (["--resume", "--list"], "--resume needs --keep"),
        (["--reuse-only", "--keep", "x", "--list"], "--reuse-only needs --resume"),
        (["--threads", "0", "--list"], "argument --threads: must be at least 1, got 0"),
        (["--device", "gpu", "--list"], "unknown device 'gpu'"),
        (["--dtype", "fp8", "--list"], "unknown dtype 'fp8'"),
    ],
)
def test_command_line_errors_are_one_line(args, message):
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_missing_recipe_and_recovery_variants_are_rows_not_crashes():
    bench = Bench.__new__(Bench)  # prepare() needs only the settings, not the loaded dense model
    bench.settings = Settings()
    row, overrides, _raw = bench.prepare(expand([Entry(recipe="no-such-recipe")], bench.settings, [0.2])[0])
    assert overrides is None and row["status"] == "not run" and "does not exist" in row["reason"]
    row, overrides, _raw = bench.prepare(expand([Entry(recipe="prunenet-random", recovery=[True])], bench.settings)[0])
    assert overrides is None and row["status"] == "not run" and "no top-level lora stage" in row["reason"]
    job_off, job_on = expand([Entry(recipe="lorap", recovery=[False, True])], bench.settings, [0.3])
    _row_off, overrides, raw = bench.prepare(job_off)
    assert "target.ratio=0.3" in overrides and overrides[-1] == "stages.1.args.steps=0"
    assert raw["stages"][1]["args"]["steps"] == 0 and raw["target"]["ratio"] == 0.3
    _row_on, overrides, raw = bench.prepare(job_on)
    assert raw["stages"][1]["args"]["steps"] == 50
    row, overrides, _raw = bench.prepare(
        expand([Entry(recipe="magnitude", overrides=["stages.0.args.scorer=bogus"])], bench.settings, [0.2])[0]
    )
    assert overrides is None and row["status"] == "failed" and "scorer" in row["reason"]


def test_resume_reuses_a_row_measured_under_the_same_settings(tmp_path):
    import yaml

    from benchmarks.grid_rows import ROW_FILE

    bench = Bench.__new__(Bench)
    bench.settings, bench.runs, bench.resume = Settings(), tmp_path, True
    job = expand([Entry(recipe="magnitude")], bench.settings, [0.2])[0]
    _row, _overrides, raw = bench.prepare(job)
    folder = tmp_path / "magnitude-r20"  # the folder run_job uses for this row
    (folder / "model").mkdir(parents=True)
    (folder / "report.json").write_text("{}")
    (folder / "model" / "recipe.yaml").write_text(yaml.safe_dump(raw))
    assert bench.reusable(folder, raw) and bench.stored_row(folder, raw) is None  # compressed, not yet measured
    record = {"settings": bench.settings.model_dump(), "row": {"id": job.id, "metrics": {"wikitext2_ppl": 9.0}}}
    (folder / ROW_FILE).write_text(json.dumps(record))
    assert bench.stored_row(folder, raw) == {**record["row"], "evaluation_reused": True}
    # run_job returns it, and the dense model's speed in that row's pair counts towards the dense row's
    record["row"]["speed"] = {"dense_prefill_tokens_per_s": 300.0, "dense_decode_tokens_per_s": 20.0}
    (folder / ROW_FILE).write_text(json.dumps(record))
    bench.dense_speed, bench.reuse_only = [(100.0, 10.0), (200.0, 30.0)], True
    assert bench.run_job(job)["evaluation_reused"] is True
    dense = {"id": "dense"}
    bench.finish_dense(dense)
    assert dense["speed"]["prefill_tokens_per_s"] == 200.0 and dense["speed"]["decode_tokens_per_s"] == 20.0
    # --reuse-only: a row with no stored measurement is "not run", never compressed
    other = expand([Entry(recipe="random")], bench.settings, [0.2])[0]
    row = bench.run_job(other)
    assert row["status"] == "not run" and "--reuse-only" in row["reason"] and not (tmp_path / "random-r20").exists()
    bench.settings = Settings(ppl_tokens=1024)  # other settings: measure again
    assert bench.stored_row(folder, raw) is None
    bench.settings, bench.resume = Settings(), False
    assert bench.stored_row(folder, raw) is None


def test_kept_dense_row_is_stored_and_reused_under_the_same_settings(tmp_path):
    bench = Bench.__new__(Bench)
    bench.settings, bench.runs, bench.keep, bench.resume = Settings(), tmp_path, True, True
    measured = []
    bench.dense_row = lambda: measured.append(1) or {"id": "dense", "metrics": {"wikitext2_ppl": 28.0}}
    first = bench.kept_dense_row()
    assert measured == [1] and "evaluation_reused" not in first
    assert bench.kept_dense_row() == {**first, "evaluation_reused": True} and measured == [1]
    bench.settings = Settings(ppl_tokens=1024)  # other settings: measured again (and stored for them)
    bench.kept_dense_row()
    assert measured == [1, 1]
    bench.resume = False  # without --resume: always measured
    bench.kept_dense_row()
    assert measured == [1, 1, 1]


# ------------------------------------------------------------------------------- size extraction


def test_structure_params_from_reports_and_models(llama):
    from slimkit.engine.report import StageReport
    from slimkit.primitives.lowrank import LowRankLinear

    assert StageReport.from_stage({"fractions": {}}, trains=False, calibration_tokens=640).params_added is None
    projection = StageReport.from_stage({"residual_params": 1200, "params_without_residual": 5}, False, 640)
    assert projection.params_added == 1200
    flat = projection.model_dump(mode="json")  # report.json's form: the stage's own keys beside the typed ones
    assert flat["residual_params"] == 1200 and StageReport.model_validate(flat) == projection
    model = nn.Sequential(nn.Linear(4, 4))
    model.add_module("residual_0", nn.Linear(3, 3, bias=False))
    assert residual_params_in_model(model) == 9
    model.add_module("host", nn.Module())
    model.host.add_module("basis_change", nn.Linear(2, 2))
    assert residual_params_in_model(model) == 9 + 6
    llama.model.layers[0].self_attn.q_proj = LowRankLinear(48, 48, rank=4, bias=False)
    assert lowrank_params(llama) == 4 * 48 * 2
    iterations = {"iterations": [{"seed": 0}, {"seed": 17}, {"seed": 99}]}
    assert StageReport.from_stage(iterations, False, 640).calibration_tokens == 2 * 640
    assert StageReport.from_stage({"calibration_tokens": 5, **iterations}, False, 640).calibration_tokens == 5
    lora = StageReport.from_stage({"tokens": 8}, True, 640)
    assert lora.calibration_tokens is None and lora.training_tokens == 8
    assert StageReport.from_stage({"tokens": 8}, False, 640).training_tokens is None  # calibration tokens, no training
    assert finite_numbers({"a": [1, 2.5, {"b": True}]}) and not finite_numbers({"a": [float("inf")]})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss inheritance is Linux behaviour")
def test_launched_runs_report_their_own_peak_memory():
    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touch every page: this process now has >= 400 MB
    child = [sys.executable, "-c", "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"]
    direct = int(subprocess.run(child, capture_output=True, text=True).stdout)
    launched = int(subprocess.run(via_launcher(child), capture_output=True, text=True).stdout)
    assert direct > 400 * 1024 > 200 * 1024 > launched  # kB
    del ballast


def test_speed_rounds_interleave_and_skip_implausible_decode(monkeypatch):
    from slimkit.primitives.evaluate.speed import Throughput

    calls = []
    rates = {"a": iter([(100.0, 10.0), (100.0, 5e9), (100.0, 12.0), (90.0, 11.0)]), "b": iter([(50.0, 5.0)] * 3)}

    def fake(model, vocab, batch, prompt_len, new_tokens, repeats):
        calls.append(model)
        prefill, decode = next(rates[model])
        return Throughput(prefill, decode, batch, prompt_len, new_tokens, repeats)

    monkeypatch.setattr("benchmarks.speed.throughput", fake)
    a, b = measure([("A", "a", 10), ("B", "b", 10)], rounds=3, prompt_len=8, new_tokens=2)
    assert calls == ["a", "b", "b", "a", "a", "a", "b"]  # order rotates; a's implausible decode is retried
    assert a["decode_samples"] == [10.0, 12.0, 11.0] and a["decode_tokens_per_s"] == 11.0
    assert b["prefill_ratio"] == 0.5 and b["decode_ratio"] == pytest.approx(5.0 / 11.0)


# ----------------------------------------------------------------------------------- tables, plots


def _result():
    dense = _row("dense", "dense", ratio=None, wikitext2_ppl=20.0, ptb_ppl=60.0, piqa_acc=0.6, zeroshot_mean_acc=0.6)
    dense["params"] = {"before": 100, "after": 100, "removed_ratio": 0.0}
    dense["layers"]["widths"] = [{"num_attention_heads": 9, "intermediate_size": 96}] * 2
    dense["layers"]["params"] = [100, 100]
    rows = [dense]
    for recipe, ppl in (("a", 30.0), ("b", 50.0)):
        for ratio, scale in ((0.1, 1.0), (0.2, 2.0)):
            row = _row(f"{recipe}@{ratio * 100:g}", recipe, ratio, wikitext2_ppl=ppl * scale, ptb_ppl=2 * ppl * scale)
            row["metrics"].update(piqa_acc=0.5, zeroshot_mean_acc=0.5)
            row["params"]["removed_ratio"] = ratio
            row["cost"] = {
                "compress_s": 12.5,
                "stages_s": {"calibration": 0.5, "0:prune": 12.0},
                "process_wall_s": 20.0,
                "peak_rss_mb": 1500.0,
                "calibration": {"dataset": "c4", "samples": 4, "seq_len": 128, "tokens": 512},
                "recovery_tokens": 0,
            }
            row["structure"] = {"residual_params": 0, "lowrank_params": 1234}
            row["speed"] = {"prefill_tokens_per_s": 110.0, "decode_tokens_per_s": 11.0, "prefill_ratio": 1.1}
            rows.append(row)
    rows.append({"id": "c@20", "recipe": "c", "ratio": 0.2, "status": "not run", "reason": "recipe 'c' does not exist"})
    claims = evaluate_claims([_claim(["a@{r} < b@{r}"], at=(10, 20)), _claim(["a@{r} < c@{r}"])], rows)
    settings = Settings(zeroshot_tasks=["piqa"], zeroshot_limit=10).model_dump()
    machine = {"cpu": "test CPU", "cores": 2, "memory_gb": 8.0, "torch_threads": 2}
    return {"name": "t", "date": "2026-01-01", "command": "python -m benchmarks.run", "settings": settings,
            "machine": machine, "versions": {"torch": "x"}, "wall_s": 60.0, "rows": rows, "claims": claims}  # fmt: skip


def test_markdown_tables_dense_first_claims_and_skipped_rows():
    text = markdown(_result(), ["/x/t-quality.png"])
    quality = text.split("## Quality")[1].split("##")[0]
    lines = [ln for ln in quality.splitlines() if ln.startswith("| `")]
    assert lines[0].startswith("| `dense` |") and len(lines) == 5
    assert "| `a@10` | 10% of model | 1 | 10.00% | 30 | 60 | 0.500 | 0.500 |" in quality
    assert "32 non-overlapping windows of 512 tokens (16,384 tokens)" in text
    assert "the first 10 examples of each of piqa (`--limit 10`)" in text
    assert "| 1,234 |" in text.split("## Size")[1]
    assert "4 x 128 = 512 tokens of c4" in text
    claims = text.split("## Paper claims")[1].split("##")[0]
    assert "| **holds** |" in claims and "| not run |" in claims
    assert "| `c@20` | not run | recipe 'c' does not exist |" in text
    assert "![t-quality](t-quality.png)" in text


def test_markdown_shows_seeded_rows_as_mean_and_spread_and_causes():
    result = _result()
    result["rows"] += _seeded("s@20", "s", [50.0, 60.0, 70.0])  # a@20 is 60
    claim = _claim(["a@{r} < s@{r}"], cause="the scorer ranks channels worse", note="paper has no such row")
    result["claims"] = evaluate_claims([claim], result["rows"])
    text = markdown(result, [])
    quality = text.split("## Quality")[1].split("##")[0]
    assert "| `s@20` | 20% of model | 3 seeds | 20.00% | 60 [50-70] |" in quality
    assert "s@20:seed1" not in quality  # the draws are in the Seeds section and the size/cost tables
    assert "| `s@20` | 0, 1, 2 | wikitext2_ppl | 60 | 50-70 | 50, 60, 70 |" in text.split("## Seeds")[1]
    assert "`s@20:seed1`" in text.split("## Size")[1]
    claims = text.split("## Paper claims")[1].split("##")[0]
    assert "**within noise**" in claims and "the scorer ranks channels worse Note: paper has no such row" in claims
    assert "worst seed against B's best" in text


def test_summary_and_pivot_tables_for_the_readme(capsys, tmp_path):
    from benchmarks.tables import main, pivot_table, summary_table

    result = _result()
    summary = summary_table(result["rows"], result["settings"])
    assert summary[2].startswith("| `dense` | 0.00% | 20 | 60 | 0.600 |")
    assert "| `a@10` | 10.00% | 30 | 60 | 0.500 | 80.0% | 1.10 | - | 12 | 1500 |" in summary
    pivot = pivot_table(result["rows"], "wikitext2_ppl")
    assert pivot[:4] == ["| recipe | 10% | 20% |", "| --- | ---: | ---: |", "| dense | 20 |  |", "| `a` | 30 | 60 |"]
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert main([str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert "| `b` | 50 | 100 |" in printed and "| holds |" in printed


def test_mean_accuracy_without_one_task():
    from benchmarks.tables import _add_mean_without

    rows = [_row("x@10", "x", 0.1, piqa_acc=0.6, boolq_acc=0.9, arc_easy_acc=0.4), _row("y@10", "y", 0.1, piqa_acc=0.5)]
    _add_mean_without(rows, ["piqa", "boolq", "arc_easy"], "boolq")
    assert rows[0]["metrics"]["zeroshot_mean_acc_without_boolq"] == pytest.approx(0.5)
    assert "zeroshot_mean_acc_without_boolq" not in rows[1]["metrics"]  # arc_easy missing: no mean


@pytest.mark.slow
def test_plots_are_written(tmp_path):
    rows = _result()["rows"]
    assert plot_quality(rows, tmp_path / "t-quality.png").stat().st_size > 1000
    paths = plot_widths(rows, tmp_path / "t")
    assert [p.name for p in paths] == ["t-widths-r10.png", "t-widths-r20.png"]
    assert plot_quality(rows[:1], tmp_path / "none.png") is None


# ------------------------------------------------------------------------------------ real smoke run


@pytest.mark.real
def test_quick_benchmark_smoke(tmp_path):
    """The whole quick grid (`make bench-quick`) at the smallest evaluation budgets, as CI's smoke run: every row is
    produced and finite."""
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path), "--name", "smoke"]
    command += ["--speed-rounds", "1", "--ppl-tokens", "512", "--zeroshot-limit", "2"]  # one window, two examples
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("*-smoke.json")
    result = json.loads(path.read_text())
    rows = {r["id"]: r for r in result["rows"]}
    quick = load_grid(ROOT / "benchmarks" / "grid.yaml").quick.grid
    assert list(rows) == ["dense", *(f"{e.recipe}@20" for e in quick)]
    for row in rows.values():
        assert row["status"] == "ok", (row["id"], row.get("reason"))
        metrics = row["metrics"]
        assert {"wikitext2_ppl", "ptb_ppl", "piqa_acc", "arc_easy_acc", "zeroshot_mean_acc"} <= set(metrics)
        assert finite_numbers(metrics) and finite_numbers(row["params"]) and finite_numbers(row["macs"])
        assert row["speed"]["prefill_tokens_per_s"] > 0 and math.isfinite(row["speed"]["decode_ratio"])
        assert len(row["layers"]["widths"]) == len(row["layers"]["params"]) == 30
    for name, row in rows.items():
        if name != "dense":
            assert row["cost"]["peak_rss_mb"] > 0 and finite_numbers(row["cost"]["stages_s"]), name
            assert 0.15 < row["achieved"] < 0.25, name  # of each recipe's target.of (PruneNet's: the MLP)
    assert rows["lorap@20"]["structure"]["lowrank_params"] > 0
    assert rows["sp3-oneshot@20"]["structure"]["residual_params"] > 0
    assert {c["verdict"] for c in result["claims"]} <= {HOLDS, FAILS, NOISE, NOT_RUN}
    assert path.with_suffix(".md").is_file()
    assert (tmp_path / path.name.replace(".json", "-quality.png")).is_file()
    assert (tmp_path / path.name.replace(".json", "-widths-r20.png")).is_file()


def test_glue_grid_claims_over_seeds_and_table(tmp_path):
    from benchmarks.glue_grid import main
    from benchmarks.glue_report import decide_claims, markdown
    from benchmarks.glue_rows import GlueGrid, trace_summary

    grid = GlueGrid.model_validate(
        {
            "settings": {"tasks": ["sst2", "rte"], "seeds": [0, 1], "ratios": [0.5]},
            "rows": [{"name": "sp3-bert", "recipe": "sp3-bert"}, {"name": "cofi-bert", "recipe": "cofi-bert"}],
            "claims": [{"id": "sp3-vs-cofi", "claim": "c", "source": "s", "better": "sp3-bert", "worse": "cofi-bert"}],
        }
    )

    def row(task, name, seed, value, status="ok"):
        return {
            "id": f"{task}:{name}@50#s{seed}",
            "task": task,
            "name": name,
            "ratio": 0.5,
            "seed": seed,
            "status": status,
            "value": value,
        }

    rows = [
        {"id": "sst2:task-model#s0", "task": "sst2", "name": "task-model", "seed": 0, "status": "ok", "value": 0.84},
        row("sst2", "sp3-bert", 0, 0.80),
        row("sst2", "sp3-bert", 1, 0.81),
        row("sst2", "cofi-bert", 0, 0.79),
        row("sst2", "cofi-bert", 1, 0.78),
        row("rte", "sp3-bert", 0, 0.55),
        row("rte", "sp3-bert", 1, 0.52),
        row("rte", "cofi-bert", 0, 0.53),
        row("rte", "cofi-bert", 1, None, status="failed"),
    ]
    claims = {c["id"]: c for c in decide_claims(rows, grid, ["sst2", "rte"])}
    assert claims["sp3-vs-cofi:sst2@50"]["verdict"] == "holds"  # every one of the 4 pairings
    assert claims["sp3-vs-cofi:rte@50"]["verdict"] == "within noise"  # 0.55 > 0.53 but 0.52 < 0.53
    # SP3's gain per seed (same task model): rte s0 +0.02 (s1's cofi failed) against sst2 s0 +0.01, s1 +0.03
    assert claims["sp3-gain-small-data"]["verdict"] == "within noise"
    assert claims["sp3-gain-small-data"]["evidence"].endswith("1 of 2 pairings")
    lower = [{**r, "value": 0.53} if r["id"] == "rte:sp3-bert@50#s0" else r for r in rows]  # rte s0 gain 0
    assert decide_claims(lower, grid, ["sst2", "rte"])[-1]["verdict"] == "does not hold"
    assert "provisional" not in claims["sp3-vs-cofi:sst2@50"]  # 2 of the grid's 2 seeds on each side
    assert claims["sp3-vs-cofi:rte@50"]["provisional"] == "1 of 2 seeds"  # cofi-bert's seed 1 failed
    assert claims["sp3-gain-small-data"]["provisional"] == "fewer than 2 seeds on rte"
    result = {"name": "t", "date": "d", "command": "c", "machine": {}, "rows": [], "claims": list(claims.values())}
    assert "**within noise** (provisional: 1 of 2 seeds)" in markdown(result)
    rows = rows[:5]
    assert decide_claims(rows, grid, ["sst2", "rte"])[1]["verdict"] == "not run"
    # the trace: every tenth of the steps, and the mean gap over the last fifth
    summary = trace_summary({"expected_sparsity": [i / 10 for i in range(1, 11)]}, 0.5)
    assert summary["trace"] == [i / 10 for i in range(1, 11)]
    assert summary["settle_gap"] == pytest.approx((0.4 + 0.5) / 2)
    assert trace_summary(None, 0.5) == {"trace": None, "settle_gap": None}
    result = {"name": "t", "date": "d", "command": "c", "machine": {}, "rows": rows, "claims": [], "wall_s": 1}
    table = markdown(result)
    assert "| sst2 | sp3-bert@50 | 2/2 | 0.8050 [0.8000-0.8100] |" in table
    rows[1]["device"] = "cuda"  # seeds run on two devices: the row says how many on each
    assert "| sst2 | sp3-bert@50 | 2/2 (cpu 1, cuda 1) | 0.8050" in markdown({**result, "rows": rows})
    bad = tmp_path / "bad.yaml"
    bad.write_text("rows: [{name: a, recipe: sp3-bert}]\nclaims: [{id: x, claim: c, source: s, better: a, worse: b}]\n")
    assert main(["--grid", str(bad)]) == 2
    bad.write_text("settings: {tasks: [rte]}\nrows: [{name: a, recipe: sp3-bert, tasks: [stsb]}]\n")
    assert main(["--grid", str(bad)]) == 2  # a row's task outside the grid's
    assert main(["--tasks", "cola"]) == 2 and main(["--seeds", "7"]) == 2
    assert main(["--jobs", "0"]) == 2 and main(["--deadline-s", "0"]) == 2
    assert main(["--reuse", str(tmp_path / "missing.json")]) == 2
    assert main(["--rerun", "sst2:sp3-bert@50#s0"]) == 2  # needs --reuse
    assert main(["--ratios", "0.3"]) == 2
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": []}))
    assert main(["--reuse", str(earlier), "--rerun", "sst2:nope@50#s0"]) == 2


def test_glue_grid_job_orders():
    from benchmarks.glue_grid import job_list
    from benchmarks.glue_rows import GlueGrid

    grid = GlueGrid.model_validate(
        {
            "settings": {"tasks": ["rte", "mrpc"], "seeds": [0, 1], "ratios": [0.5, 0.7]},
            "rows": [{"name": "a", "recipe": "sp3-bert"}, {"name": "b", "recipe": "cofi-bert", "ratios": [0.7]}],
        }
    )
    a, b = grid.rows
    # seed by seed: that seed's task models, then its rows task by task
    jobs = job_list(grid, ["rte", "mrpc"], [0, 1], [a, b], [0.5, 0.7], "seed")
    assert jobs[:7] == [
        ("model", "rte", 0),
        ("model", "mrpc", 0),
        ("row", "rte", 0, "a", 0.5),
        ("row", "rte", 0, "a", 0.7),
        ("row", "rte", 0, "b", 0.7),
        ("row", "mrpc", 0, "a", 0.5),
        ("row", "mrpc", 0, "a", 0.7),
    ]
    assert len(jobs) == 2 * (2 + 2 * 3)
    # row by row in the order given (b first), every task and seed of a row together; only the ratios asked for
    jobs = job_list(grid, ["rte", "mrpc"], [0, 1], [b, a], [0.7], "row")
    assert jobs == [
        ("model", "rte", 0),
        ("model", "rte", 1),
        ("model", "mrpc", 0),
        ("model", "mrpc", 1),
        ("row", "rte", 0, "b", 0.7),
        ("row", "rte", 1, "b", 0.7),
        ("row", "mrpc", 0, "b", 0.7),
        ("row", "mrpc", 1, "b", 0.7),
        ("row", "rte", 0, "a", 0.7),
        ("row", "rte", 1, "a", 0.7),
        ("row", "mrpc", 0, "a", 0.7),
        ("row", "mrpc", 1, "a", 0.7),
    ]
    # a row limited to some tasks runs only there (its task models still come first)
    only_mrpc = b.model_copy(update={"tasks": ["mrpc"]})
    jobs = job_list(grid, ["rte", "mrpc"], [0], [only_mrpc], [0.7], "row")
    assert jobs == [("model", "rte", 0), ("model", "mrpc", 0), ("row", "mrpc", 0, "b", 0.7)]
    assert job_list(grid, ["rte", "mrpc"], [0], [only_mrpc], [0.7], "seed")[-1] == ("row", "mrpc", 0, "b", 0.7)


def test_glue_grid_reuses_finished_rows_of_an_earlier_run(tmp_path):
    from benchmarks.glue_grid import reused_rows

    model = tmp_path / "tm" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    earlier = tmp_path / "earlier.json"
    rows = [
        {"id": "sst2:task-model#s0", "status": "ok", "model": str(model)},
        {"id": "rte:task-model#s0", "status": "ok", "model": str(tmp_path / "gone")},
        {"id": "sst2:sp3-bert@50#s0", "status": "ok", "value": 0.8},
        {"id": "sst2:cofi-bert@50#s0", "status": "failed", "reason": "stopped at the deadline"},
    ]
    earlier.write_text(json.dumps({"device": "cuda", "rows": rows}))
    jobs = [("model", "sst2", 0), ("model", "rte", 0), ("row", "sst2", 0, "sp3-bert", 0.5)]
    jobs += [("row", "sst2", 0, "cofi-bert", 0.5), ("row", "sst2", 1, "sp3-bert", 0.5), ("row", "rte", 0, "x", 0.5)]
    kept = reused_rows(earlier, jobs)
    # the finished row and the task model still on disk; not the failed row, the lost model a row still needs, or
    # an unrun seed; every kept row says where it ran
    assert set(kept) == {("model", "sst2", 0), ("row", "sst2", 0, "sp3-bert", 0.5)}
    assert {row["device"] for row in kept.values()} == {"cuda"}
    # a lost task model none of whose rows is left to run is kept (not trained again for nothing)
    rows += [{"id": "rte:x@50#s0", "status": "ok", "value": 0.5, "device": "cpu"}]
    earlier.write_text(json.dumps({"device": "cuda", "rows": rows}))
    kept = reused_rows(earlier, jobs)
    assert ("model", "rte", 0) in kept and kept[("row", "rte", 0, "x", 0.5)]["device"] == "cpu"
    # a row run again needs its task model: the lost one is then trained again
    kept = reused_rows(earlier, jobs, frozenset({"rte:x@50#s0"}))
    assert ("model", "rte", 0) not in kept and ("row", "rte", 0, "x", 0.5) not in kept


def test_scale_power_fit_and_recipe_without_recovery():
    from benchmarks.scale_recipes import scale_recipe, target_of
    from benchmarks.scale_report import fit_power
    from benchmarks.scale_report import markdown as scale_markdown
    from benchmarks.scale_shapes import REAL

    fit = fit_power([8, 16, 32], [3.0 * 8**1.5, 3.0 * 16**1.5, 3.0 * 32**1.5])
    assert fit["exponent"] == pytest.approx(1.5) and fit["r2"] == pytest.approx(1.0) and fit["points"] == 3
    assert fit_power([8], [1.0]) is None and fit_power([8, 8], [1.0, 2.0]) is None
    raw, dropped = scale_recipe("lorap", 8, 64, of="layers")
    assert dropped == ["lora"] and all("sequential" in s for s in raw["stages"])
    assert raw["target"] == {"ratio": 0.2, "of": "layers", "strict": False}
    assert raw["calibration"]["samples"] == 8 and raw["calibration"]["batch_size"] <= 8
    assert [c["args"]["ratio"] for c in raw["stages"][0]["sequential"]] == [0.2, 0.2]
    assert target_of(REAL["llama-3.2-1b"], "lorap") == "model"
    assert REAL["llama-3.2-1b"].params()["total"] == pytest.approx(1.236e9, rel=0.01)  # the published size
    assert REAL["qwen2.5-1.5b"].params()["total"] == pytest.approx(1.544e9, rel=0.01)
    offload = {"id": "x/wanda-channels@offload", "shape": "x", "kind": "offload", "recipe": "wanda-channels"}
    offload |= {"status": "ok", "weights_mb": 4096.0, "max_memory": "1.5GiB", "peak_rss_mb": 2048.0, "offloaded": True}
    offload |= {"peak_rss_above_baseline_mb": 1536.0, "peak_gpu_mb": None, "load_s": 1.0, "compress_s": 2.0}
    offload |= {"save_s": 0.5, "achieved": 0.2, "notes": []}
    result = {"date": "d", "command": "c", "machine": {"cpu": "cpu", "cores": 2, "memory_gb": 1.0, "torch_threads": 2}}
    result["machine"]["python"] = "3.11"
    result |= {
        "versions": {"torch": "x"},
        "rows": [offload],
        "baseline": {"id": "b", "status": "ok", "peak_rss_mb": 512.0},
    }
    result |= {"settings": {"device": "cpu", "dtype": "float32", "samples": 8, "seq_len": 128, "recipes": ["lorap"]}}
    text = scale_markdown(result)
    assert (
        "## Offload" in text and "| 4.00 | 1.5GiB | 0.50 | 2.00 | 1.50 |" in text and "cost (time, memory) only" in text
    )


def test_scale_recipe_variants_apply_set_overrides(tmp_path):
    # NAME@KEY=VALUE: the bundled recipe with slimkit --set overrides, its own row; the cost run's target stays
    from benchmarks.scale import build_parser, plan
    from benchmarks.scale_recipes import recipe_weight, scale_recipe, split_variant

    variant = "sp3-llm@stages.1.args.learning_rate=0@stages.1.args.mask_steps=300"
    assert split_variant(variant) == ("sp3-llm", ["stages.1.args.learning_rate=0", "stages.1.args.mask_steps=300"])
    raw, dropped = scale_recipe(variant, 8, 128)
    assert raw["stages"][1]["args"]["learning_rate"] == 0 and raw["stages"][1]["args"]["mask_steps"] == 300
    assert raw["target"] == {"ratio": 0.2, "of": "model", "strict": False} and dropped == []
    assert recipe_weight(variant) == recipe_weight("sp3-llm")
    common = ["--no-sweeps", "--offload-memory", "none", "--configs", "w64-L2", "--out", str(tmp_path)]
    _shapes, recipes, _offload = plan(build_parser().parse_args([*common, "--recipes", f"prunenet,{variant}"]))
    assert recipes == ["prunenet", variant]
    with pytest.raises(BenchError, match="unknown recipe"):
        plan(build_parser().parse_args([*common, "--recipes", "nope@target.ratio=0.3"]))
    with pytest.raises(BenchError, match=r"--recipes: sp3-llm@stages\.9\.args\.x=1: --set stages\.9\.args\.x: '9'"):
        plan(build_parser().parse_args([*common, "--recipes", "sp3-llm@stages.9.args.x=1"]))


@pytest.mark.real
def test_scale_benchmark_quick_smoke(tmp_path):
    """`python -m benchmarks.scale --quick`: tiny random-weight shapes (the smollm2-135m tokenizer) in three
    processes, the depth and width sweeps and their fitted exponents (the offload row is left out for time)."""
    command = [sys.executable, "-m", "benchmarks.scale", "--quick", "--out", str(tmp_path), "--name", "smoke"]
    command += [
        "--models-dir",
        str(tmp_path / "models"),
        "--samples",
        "2",
        "--seq-len",
        "32",
        "--offload-memory",
        "none",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("*-smoke.json")
    result = json.loads(path.read_text())
    rows = result["rows"]
    assert {r["kind"] for r in rows} == {"depth", "width"} and len(rows) == 3
    for row in rows:
        assert row["status"] == "ok", (row["id"], row.get("reason"))
        assert row["compress_s"] > 0 and row["load_s"] > 0 and row["s_per_layer"] > 0 and row["peak_rss_mb"] > 0
        assert all(v >= 0 for v in row["stages_s"].values())
    fits = {(f["sweep"], f["cost_key"]): f for f in result["exponents"]}
    assert math.isfinite(fits[("depth", "compress_s")]["exponent"])
    assert math.isfinite(fits[("width", "compress_s")]["exponent"])
    text = path.with_suffix(".md").read_text()
    assert "cost (time, memory) only" in text and "## Growth exponents" in text


def test_device_and_dtype_go_into_the_recipe_so_resumed_rows_match():
    # the run folder's recipe.yaml carries model.device/dtype, so --resume recognises a row compressed on a GPU; a
    # row stored before the settings had device/dtype reads as measured under the defaults (auto)
    from benchmarks.grid_rows import normalised_settings

    bench = Bench.__new__(Bench)
    bench.settings = Settings(device="cuda", dtype="float32")
    _row, overrides, raw = bench.prepare(expand([Entry(recipe="lorap")], bench.settings, [0.2])[0])
    assert "model.device=cuda" in overrides and "model.dtype=float32" in overrides
    assert raw["model"]["device"] == "cuda" and raw["model"]["dtype"] == "float32"
    bench.settings = Settings()
    _row, overrides, raw = bench.prepare(expand([Entry(recipe="lorap")], bench.settings, [0.2])[0])
    assert not any(o.startswith(("model.device", "model.dtype")) for o in overrides)
    old = {k: v for k, v in Settings().model_dump().items() if k not in ("device", "dtype")}
    assert normalised_settings(old) == Settings().model_dump()
    assert normalised_settings(old) != Settings(device="cuda").model_dump()


def test_results_say_where_rows_were_measured():
    from benchmarks.tables import measured_on

    gpu = {"device": "cuda:0", "dtype": "float32", "gpu": "NVIDIA H100 80GB HBM3"}
    result = {"rows": [{"placement": gpu}, {"placement": gpu}, {"placement": None}], "settings": {}, "machine": {}}
    assert measured_on(result) == "float32, CUDA (NVIDIA H100 80GB HBM3)"
    result["rows"].append({"placement": {"device": "cpu", "dtype": "bfloat16"}})
    assert measured_on(result) == "float32, CUDA (NVIDIA H100 80GB HBM3); bfloat16, CPU"
    # rows without placements (older results): the settings on the benchmark's machine
    assert measured_on({"rows": [{}], "settings": {"device": "auto", "dtype": "auto"}, "machine": {}}) == "float32, CPU"


@pytest.mark.slow
def test_scale_quick_with_two_jobs_runs_rows_side_by_side(tmp_path):
    """`python -m benchmarks.scale --quick --jobs 2`: the sweep rows as two processes at a time, each with its own
    peak RSS and CPU seconds, the rows that overlapped saying so (a byte tokenizer: no real model needed)."""
    from tests.tiny import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path / "tokenizer")
    command = [sys.executable, "-m", "benchmarks.scale", "--quick", "--jobs", "2", "--no-baseline", "--threads", "1"]
    command += [
        "--offload-memory",
        "none",
        "--samples",
        "2",
        "--seq-len",
        "32",
        "--tokenizer",
        str(tmp_path / "tokenizer"),
    ]
    command += ["--out", str(tmp_path), "--name", "jobs", "--models-dir", str(tmp_path / "models")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("*-jobs.json")
    result = json.loads(path.read_text())
    rows = {r["id"]: r for r in result["rows"]}
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows.values()), rows
    # the second row starts beside the first (two tiny plans fit in 0.9 of the RAM); the third beside whichever runs
    assert rows["w64-L12/wanda-channels"]["beside"] and result["settings"]["concurrency"]["jobs"] == 2
    for row in rows.values():
        assert row["peak_rss_mb"] > 0 and row["process_cpu_s"] > 0
        assert row["expected_peak_mb"] > row["planned_peak_mb"] > 0
    assert "| beside " in path.with_suffix(".md").read_text()
