"""``benchmarks/prunenet_sp3_cost.py`` at tiny widths: every variant timed, the counts and the projection."""

from __future__ import annotations

import json

import torch

from benchmarks.prunenet_sp3_cost import main


def test_quick_run_times_every_variant_and_projects_the_counts(tmp_path):
    out = tmp_path / "cost.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--quick", "--json", str(out), "--layers", "3", "--episodes", "2", "--mask-steps", "5"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    prunenet, sp3 = result["prunenet"], result["sp3"]
    assert prunenet["kept_rows"] == 141  # 176 MLP channels, 20% removed
    assert prunenet["counts"] == {"full_spectra": 3, "kept_spectra": 6, "policy_steps": 6}
    # the three methods agree on the penalty of this draw
    assert prunenet["ks_gram_float32"] == prunenet["ks_gram_float64"] == prunenet["ks_svd_float32"]
    expected = 3 * prunenet["full_gram_float32_s"] + 6 * (prunenet["kept_svd_float32_s"] + prunenet["policy_step_s"])
    assert prunenet["projected_svd_float32_s"] == expected
    assert sp3["counts"] == {"steps": 5, "layer_passes": 15, "head_passes": 5} and sp3["tokens"] == 512
    frozen = 3 * sp3["layer_forward_backward_frozen_s"] + sp3["head_forward_backward_frozen_s"]
    assert sp3["projected_step_frozen_s"] == frozen and sp3["projected_run_frozen_s"] == 5 * frozen
    trained = 3 * (sp3["layer_forward_backward_weights_s"] + sp3["layer_adamw_step_s"])
    assert sp3["projected_step_weights_s"] == trained + sp3["head_forward_backward_frozen_s"]
