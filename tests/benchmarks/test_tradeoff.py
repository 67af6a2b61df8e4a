"""benchmarks/tradeoff.py: a grid's quality joined with llama.cpp speed files, on hand-made rows."""

from __future__ import annotations

import json

import pytest

from benchmarks.tradeoff import TradeoffError, main, tradeoff_points


def _grid() -> dict:
    def seed(n: int, ppl: float) -> dict:
        return {
            "id": f"deploy@20:seed{n}",
            "seed": n,
            "seed_of": "deploy@20",
            "recipe": "deploy",
            "ratio": 0.2,
            "status": "ok",
            "run_folder": f"runs/deploy-r20_seed{n}",
            "metrics": {"wikitext2_ppl": ppl, "ptb_ppl": 2 * ppl},
        }

    return {
        "settings": {"model": "tiny-llama"},
        "rows": [
            {"id": "dense", "recipe": "dense", "status": "ok", "metrics": {"wikitext2_ppl": 10.0, "ptb_ppl": 40.0}},
            seed(0, 18.0),
            seed(1, 22.0),
            {
                "id": "lorap@10",
                "recipe": "lorap",
                "ratio": 0.1,
                "status": "ok",
                "run_folder": "runs/lorap-r10",
                "metrics": {"wikitext2_ppl": 15.0},
            },
        ],
    }


def _speed(gguf_type: str, models: list[tuple[str, int, float, float]]) -> dict:
    rows = [
        {"model": m, "prefill_ratio": p, "decode_ratio": d, "export": {"bytes": b, "architecture": "deci"}}
        for m, b, p, d in models
    ]
    return {"settings": {"backend": "llama.cpp", "type": gguf_type, "rounds": 3}, "rows": rows}


def test_points_take_the_seeded_mean_and_the_measured_draws_speed():
    speed = _speed("f16", [("tiny-llama", 1000, 1.0, 1.0), ("/x/deploy-r20_seed1/model", 800, 1.25, 1.2)])
    speed_q8 = _speed("q8_0", [("tiny-llama", 500, 1.0, 1.0), ("/x/lorap-r10/model", 550, 0.6, 0.9)])
    [deploy, lorap] = tradeoff_points(_grid(), [speed, speed_q8])
    # quality: the mean of both seeds (20 / 10 = 2.0; PTB 40 / 40), speed and size: the draw llama.cpp measured
    assert deploy.row == "deploy@20" and deploy.draws == 2 and deploy.measured_folder == "deploy-r20_seed1"
    assert deploy.wikitext2_x == pytest.approx(2.0) and deploy.ptb_x == pytest.approx(1.0)
    assert (deploy.size_x, deploy.prefill_x, deploy.decode_x, deploy.gguf_type) == (0.8, 1.25, 1.2, "f16")
    assert lorap.wikitext2_x == pytest.approx(1.5) and lorap.ptb_x is None and lorap.size_x == pytest.approx(1.1)


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (_speed("f16", [("other-model", 1, 1.0, 1.0)]), "the grid's dense model 'tiny-llama' must come first"),
        (_speed("f16", [("tiny-llama", 1, 1.0, 1.0), ("/x/unknown/model", 1, 1.0, 1.0)]), "no finished row"),
        ({"settings": {"backend": "torch"}, "rows": []}, "llama.cpp is needed"),
    ],
)
def test_a_speed_file_that_does_not_join_is_refused(run, message):
    with pytest.raises(TradeoffError, match=message):
        tradeoff_points(_grid(), [run])


def test_command_writes_table_and_plot_or_nothing(tmp_path, capsys):
    grid, good, bad = tmp_path / "grid.json", tmp_path / "f16.json", tmp_path / "bad.json"
    grid.write_text(json.dumps(_grid()))
    good.write_text(
        json.dumps(_speed("f16", [("tiny-llama", 1000, 1.0, 1.0), ("runs/deploy-r20_seed0", 800, 1.3, 1.1)]))
    )
    bad.write_text(json.dumps(_speed("f16", [("tiny-llama", 1000, 1.0, 1.0), ("runs/nope/model", 800, 1.3, 1.1)])))
    assert main([str(grid), str(bad), "--out", str(tmp_path / "refused")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not list(tmp_path.glob("refused*"))
    assert main([str(grid), str(good), "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out.md").read_text()
    assert (
        "| deploy@20 (quality: mean of 2) | f16 | 2.00 | 1.00 | 0.800 | 1.30 | 1.10 | deci | deploy-r20_seed0 |"
        in table
    )
    assert (tmp_path / "out.png").stat().st_size > 0
