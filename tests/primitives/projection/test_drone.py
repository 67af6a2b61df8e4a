"""MHA intermediate projections (SP3 Eqs. 10–13, Appendix A): V/O by PCA, Q/K by DRONE."""

from __future__ import annotations

import copy

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.attention import (
    attention_projection,
    drone_qk,
    head_features,
    project_attention_weights,
    score_error,
    truncate,
    vo_projection,
)
from tests.tiny import tiny_bert, tiny_opt


def _random_case(seed: int, d: int = 24, d_h: int = 8, heads: int = 3, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    w = {name: torch.randn(heads * d_h, d, generator=g, dtype=torch.float64) / d**0.5 for name in "qkv"}
    b = {name: torch.randn(heads * d_h, generator=g, dtype=torch.float64) for name in "qkv"}
    w_o = torch.randn(d, heads * d_h, generator=g, dtype=torch.float64)
    return x, w, b, w_o


def test_full_rank_projections_leave_scores_and_values_unchanged():
    x, w, b, w_o = _random_case(0)
    heads, d_h = 3, 8
    proj = attention_projection(x, w["q"], w["k"], w["v"], heads, b_q=b["q"], b_k=b["k"], b_v=b["v"])
    eye = torch.eye(d_h, dtype=torch.float64)
    for h in range(heads):
        assert torch.allclose(proj.p_q[h].T @ proj.p_k[h], eye, atol=1e-8)  # M = P_Qᵀ P_K = I
        assert torch.allclose(proj.p_o[h] @ proj.p_v[h], eye, atol=1e-10)  # P_O P_V = U Uᵀ = I
    assert bool((proj.sigma_qk[:, :-1] >= proj.sigma_qk[:, 1:]).all())
    fused = project_attention_weights(proj, w["q"], w["k"], w["v"], w_o, b_q=b["q"], b_k=b["k"], b_v=b["v"])
    fresh = torch.randn(40, x.shape[1], generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def feats(kind: str, weights: dict) -> torch.Tensor:
        return head_features(weights[f"w_{kind}"], fresh, heads, weights[f"b_{kind}"])

    original = {f"w_{k}": w[k] for k in "qkv"} | {f"b_{k}": b[k] for k in "qkv"} | {"w_o": w_o}
    for weights in (original, fused):
        weights["scores"] = feats("q", weights).mT @ feats("k", weights)  # X_Qᵀ X_K per head
        v = feats("v", weights)
        weights["out"] = sum(weights["w_o"][:, h * d_h : (h + 1) * d_h] @ v[h] for h in range(heads))  # Σ_h W_O^h v_h
    # on tokens the projections never saw
    assert torch.allclose(original["scores"], fused["scores"], atol=1e-7)
    assert torch.allclose(original["out"], fused["out"], atol=1e-8)
    assert not torch.allclose(original["w_q"], fused["w_q"])


@pytest.mark.parametrize("factory", [tiny_bert, tiny_opt])
def test_full_rank_projection_is_lossless_in_a_model(factory):
    model = factory()
    view = ModelView(model)
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(3, model.config.vocab_size, (2, 11), generator=g)}
    with torch.no_grad():
        out = model(**inputs)
        ref = out.logits if hasattr(out, "logits") else out.last_hidden_state
    projected = copy.deepcopy(model)
    pview = ModelView(projected)
    for layer, player in zip(view.layers, pview.layers, strict=True):
        x = torch.randn(64, view.hidden_size, generator=g)  # calibration features of the block input
        q, k, v, o = (layer.linear(r) for r in "qkvo")
        proj = attention_projection(
            x, q.weight, k.weight, v.weight, layer.num_heads, b_q=q.bias, b_k=k.bias, b_v=v.bias
        )
        new = project_attention_weights(
            proj, q.weight, k.weight, v.weight, o.weight, b_q=q.bias, b_k=k.bias, b_v=v.bias
        )
        with torch.no_grad():
            for role in "qkv":
                player.linear(role).weight.copy_(new[f"w_{role}"])
                player.linear(role).bias.copy_(new[f"b_{role}"])
            player.linear("o").weight.copy_(new["w_o"])
        assert not torch.allclose(player.linear("q").weight, q.weight)
    with torch.no_grad():
        out = projected(**inputs)
        got = out.logits if hasattr(out, "logits") else out.last_hidden_state
    assert torch.allclose(got, ref, atol=1e-4)


def test_drone_truncation_is_the_optimal_rank_k_score_approximation():
    # Appendix A: M_k = P_Q[:k]ᵀ P_K[:k] minimises ||X_Qᵀ X_K − X_Qᵀ M X_K|| over rank-k M
    g = torch.Generator().manual_seed(0)
    d, d_h, n = 20, 8, 50
    x = torch.randn(d, n, generator=g, dtype=torch.float64) * torch.linspace(3, 0.2, d, dtype=torch.float64)[:, None]
    w_q = torch.randn(d_h, d, generator=g, dtype=torch.float64)
    w_k = torch.randn(d_h, d, generator=g, dtype=torch.float64)
    f_q, f_k = w_q @ x, w_k @ x
    p_q, p_k, sigma_z = drone_qk(f_q, f_k)
    u1 = torch.linalg.svd(f_q, full_matrices=False)[0]
    a_u, a_s, a_vh = torch.linalg.svd(w_q.T @ w_k)
    for k in range(1, d_h):
        m_k = p_q[:k].T @ p_k[:k]
        assert int(torch.linalg.matrix_rank(m_k)) == k
        best = score_error(f_q, f_k, m_k)
        assert best == pytest.approx(float(sigma_z[k:].square().sum().sqrt()), rel=1e-8)  # Eckart–Young on Z
        # the data-free alternative: truncated SVD of W_Qᵀ W_K, compared in score space
        a_k = a_u[:, :k] @ torch.diag(a_s[:k]) @ a_vh[:k]
        plain = float(torch.linalg.matrix_norm(x.T @ (w_q.T @ w_k) @ x - x.T @ a_k @ x))
        assert best <= plain + 1e-9
        # PCA of the query features alone, and random rank-k matrices
        pca_q = u1[:, :k] @ u1[:, :k].T
        assert best <= score_error(f_q, f_k, pca_q) + 1e-9
        for _ in range(50):
            a = torch.randn(d_h, k, generator=g, dtype=torch.float64)
            b = torch.randn(k, d_h, generator=g, dtype=torch.float64)
            assert best <= score_error(f_q, f_k, a @ b) + 1e-9
        # small rank-k perturbations of the optimum do not improve it
        left, right = p_q[:k].T, p_k[:k]
        for _ in range(20):
            da = 1e-3 * torch.randn(left.shape, generator=g, dtype=torch.float64)
            db = 1e-3 * torch.randn(right.shape, generator=g, dtype=torch.float64)
            assert best <= score_error(f_q, f_k, (left + da) @ (right + db)) + 1e-12


def test_guard_drops_tiny_singular_values():
    # rank-deficient query features (W_Q of rank 3) and fewer tokens than d_h for the keys
    g = torch.Generator().manual_seed(1)
    d, d_h = 16, 8
    x = torch.randn(d, 40, generator=g, dtype=torch.float64)
    w_q = torch.randn(d_h, 3, generator=g, dtype=torch.float64) @ torch.randn(3, d, generator=g, dtype=torch.float64)
    w_k = torch.randn(d_h, d, generator=g, dtype=torch.float64)
    f_q, f_k = w_q @ x, w_k @ x
    p_q, p_k, sigma = drone_qk(f_q, f_k)
    assert torch.isfinite(p_q).all() and torch.isfinite(p_k).all()
    assert bool((p_q[3:] == 0).all()) and bool((sigma[3:] == 0).all())
    assert torch.allclose(f_q.T @ p_q.T @ p_k @ f_k, f_q.T @ f_k, atol=1e-8)  # lossless on the calibration tokens
    few = x[:, :5]
    p_q, p_k, _ = drone_qk(w_q @ few, w_k @ few)
    assert torch.isfinite(p_q).all()
    assert torch.allclose((w_q @ few).T @ p_q.T @ p_k @ (w_k @ few), (w_q @ few).T @ (w_k @ few), atol=1e-8)


def test_vo_truncation_keeps_the_principal_value_components():
    g = torch.Generator().manual_seed(2)
    f_v = (
        torch.randn(2, 8, 30, generator=g, dtype=torch.float64)
        * torch.linspace(4, 0.1, 8, dtype=torch.float64)[:, None]
    )
    p_v, p_o, sigma = vo_projection(f_v)
    for k in (2, 5):
        kept = truncate(p_o.mT, k).mT @ truncate(p_v, k) @ f_v
        err = (f_v - kept).square().sum((-2, -1))
        assert torch.allclose(err, sigma[:, k:].square().sum(-1), rtol=1e-8)


def test_refuses_rope_and_gqa():
    x, w, _, _ = _random_case(0)
    with pytest.raises(SlimkitError, match="RoPE"):
        attention_projection(x, w["q"], w["k"], w["v"], 3, rope=True)
    with pytest.raises(SlimkitError, match="KV head"):
        attention_projection(x, w["q"], w["k"], w["v"], 3, n_kv_heads=1)
