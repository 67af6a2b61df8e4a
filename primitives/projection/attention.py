"""MHA intermediate-dimension PCA projections (SP3 §3.1 "MHA Intermediate Dimension PCA Projection", Eqs. 10–13).

Per head, projections inside the head (V/O by SVD, Q/K by DRONE) so that masks on the projected dimensions prune the
head's intermediate width.

Method note: docs/methods/sp3-attention-drone.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimkit.primitives.errors import SlimkitError

DEFAULT_RTOL = 1e-6
"""Relative floor on singular values of Q/K features; smaller ones are dropped, not inverted."""


def head_features(
    weight: torch.Tensor, x: torch.Tensor, n_heads: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-head projected features ``(H, d_h, N)``: head ``h`` is ``W_h xᵀ + b_h`` (the paper's ``W^{(h)} X``)."""
    if weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need weight (H*d_h, d) and x (N, d), got {tuple(weight.shape)} and {tuple(x.shape)}")
    if weight.shape[0] % n_heads:
        raise ValueError(f"{weight.shape[0]} rows do not split into {n_heads} heads")
    w = weight.detach().double()
    feats = x.detach().double() @ w.T
    if bias is not None:
        feats = feats + bias.detach().double()
    return feats.T.reshape(n_heads, weight.shape[0] // n_heads, x.shape[0])


def vo_projection(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 10 for one or many heads: ``features`` ``(..., d_h, N)`` → ``(P_V, P_O, Σ_V)``.

    ``P_V = U_Vᵀ`` and ``P_O = U_V`` are ``(..., d_h, d_h)`` (``U_V`` from the full SVD, so square and
    orthogonal even when ``N < d_h``); ``Σ_V`` is ``(..., d_h)``, zero-padded.
    """
    u, s, _ = torch.linalg.svd(features.double(), full_matrices=True)
    d_h = features.shape[-2]
    sigma = torch.zeros((*features.shape[:-2], d_h), dtype=torch.float64, device=features.device)
    sigma[..., : s.shape[-1]] = s
    return u.mT, u, sigma


def _guarded_svd(features: torch.Tensor, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_r, Σ_r)`` of ``features`` ``(d_h, N)`` keeping singular values above ``rtol · σ_max``."""
    u, s, _ = torch.linalg.svd(features, full_matrices=False)
    if s.numel() == 0 or float(s[0]) == 0.0:
        return u[:, :0], s[:0]
    keep = s > rtol * s[0]
    return u[:, keep], s[keep]


def drone_qk(
    f_q: torch.Tensor, f_k: torch.Tensor, *, rtol: float = DEFAULT_RTOL
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eqs. 11–12 for one head: query/key features ``(d_h, N)`` → ``(P_Q, P_K, Σ_Z)``.

    ``P_Q, P_K`` are ``(d_h, d_h)`` (rows beyond the rank of ``Z`` are zero), ``Σ_Z`` is ``(d_h,)``
    descending. ``P_Q[:k]ᵀ P_K[:k]`` is the optimal rank-``k`` ``M`` of Appendix A.
    """
    if f_q.dim() != 2 or f_q.shape != f_k.shape:
        raise ValueError(
            f"need query and key features of one shape (d_h, N), got {tuple(f_q.shape)}, {tuple(f_k.shape)}"
        )
    d_h = f_q.shape[0]
    u1, s1 = _guarded_svd(f_q.double(), rtol)
    u2, s2 = _guarded_svd(f_k.double(), rtol)
    z = (s1[:, None] * (u1.T @ u2)) * s2[None, :]
    uz, sz, vzh = torch.linalg.svd(z, full_matrices=False)
    root = sz.sqrt()
    p_q = torch.zeros(d_h, d_h, dtype=torch.float64, device=z.device)
    p_k = torch.zeros_like(p_q)
    r = sz.numel()
    p_q[:r] = root[:, None] * (uz.T / s1[None, :]) @ u1.T
    p_k[:r] = root[:, None] * (vzh / s2[None, :]) @ u2.T
    sigma = torch.zeros(d_h, dtype=torch.float64, device=z.device)
    sigma[:r] = sz
    return p_q, p_k, sigma


def score_error(f_q: torch.Tensor, f_k: torch.Tensor, m: torch.Tensor) -> float:
    """``||X_Qᵀ X_K − X_Qᵀ M X_K||_F`` for features ``(d_h, N)`` and ``M`` ``(d_h, d_h)`` (Eq. 19/21)."""
    f_q, f_k, m = f_q.double(), f_k.double(), m.double()
    return float(torch.linalg.matrix_norm(f_q.T @ f_k - f_q.T @ m @ f_k))


def truncate(p: torch.Tensor, rank: int) -> torch.Tensor:
    """Zero all rows of ``p`` (``(..., d_h, d_h)``) past the first ``rank``: keeping the top-``rank`` dimensions."""
    out = p.clone()
    out[..., rank:, :] = 0
    return out


@dataclass(frozen=True)
class AttentionProjection:
    """Per-head projections, each ``(H, d_h, d_h)``, and the per-head importances ``(H, d_h)``."""

    p_q: torch.Tensor
    p_k: torch.Tensor
    p_v: torch.Tensor
    p_o: torch.Tensor
    sigma_qk: torch.Tensor
    """``Σ_Z`` per head: the score energy each QK dimension carries."""
    sigma_v: torch.Tensor
    """``Σ_V`` per head: the value energy each VO dimension carries."""

    def truncated(self, qk_rank: int | None = None, vo_rank: int | None = None) -> AttentionProjection:
        """Keep the first ``qk_rank`` / ``vo_rank`` dimensions of every head (rows of ``P``, columns of ``P_O``)."""
        p_q, p_k, p_v, p_o = self.p_q, self.p_k, self.p_v, self.p_o
        if qk_rank is not None:
            p_q, p_k = truncate(p_q, qk_rank), truncate(p_k, qk_rank)
        if vo_rank is not None:
            p_v = truncate(p_v, vo_rank)
            p_o = truncate(p_o.mT, vo_rank).mT
        return AttentionProjection(p_q, p_k, p_v, p_o, self.sigma_qk, self.sigma_v)


def attention_projection(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    n_heads: int,
    *,
    b_q: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    n_kv_heads: int | None = None,
    rope: bool = False,
    qk_norm: bool = False,
    rtol: float = DEFAULT_RTOL,
) -> AttentionProjection:
    """SP3's ``P_Q, P_K, P_V, P_O`` for every head from calibration inputs ``x`` ``(N, d)`` (Algorithm 1)."""
    if qk_norm:
        raise SlimkitError(
            "MHA intermediate projections do not apply to models with per-head q/k norms (e.g. Qwen3's q_norm/k_norm)"
        )
    if rope:
        raise SlimkitError("MHA intermediate projections do not apply to RoPE models (SP3 Appendix F)")
    if n_kv_heads is not None and n_kv_heads != n_heads:
        raise SlimkitError("MHA intermediate projections need one KV head per query head (no GQA/MQA)")
    f_q = head_features(w_q, x, n_heads, b_q)
    f_k = head_features(w_k, x, n_heads, b_k)
    p_v, p_o, sigma_v = vo_projection(head_features(w_v, x, n_heads, b_v))
    qk = [drone_qk(f_q[h], f_k[h], rtol=rtol) for h in range(n_heads)]
    p_q, p_k, sigma_qk = (torch.stack(t) for t in zip(*qk, strict=True))
    return AttentionProjection(p_q, p_k, p_v, p_o, sigma_qk, sigma_v)


def _block_rows(p: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Apply per-head ``p`` ``(H, d_h, d_h)`` to the row blocks of ``weight`` ``(H·d_h, ...)``."""
    h, d_h, _ = p.shape
    blocks = weight.double().reshape(h, d_h, -1)
    return (p @ blocks).reshape(weight.shape).to(weight.dtype)


def project_attention_weights(
    proj: AttentionProjection,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    w_o: torch.Tensor,
    *,
    b_q: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """Fuse the projections into the weights (Eq. 15 without masks): returns new ``w_q, b_q, ..., w_o``.

    ``W_Q ← P_Q W_Q``, ``b_Q ← P_Q b_Q`` per head (K, V alike); ``W_O ← W_O P_O`` per head (``W_O``'s bias
    is untouched). Shapes are unchanged.
    """
    h, d_h, _ = proj.p_o.shape
    w_o_blocks = w_o.double().reshape(w_o.shape[0], h, d_h).transpose(0, 1)  # (H, d, d_h)
    out: dict[str, torch.Tensor | None] = {
        "w_q": _block_rows(proj.p_q, w_q),
        "w_k": _block_rows(proj.p_k, w_k),
        "w_v": _block_rows(proj.p_v, w_v),
        "w_o": (w_o_blocks @ proj.p_o).transpose(0, 1).reshape(w_o.shape).to(w_o.dtype),
    }
    for name, p, b in (("b_q", proj.p_q, b_q), ("b_k", proj.p_k, b_k), ("b_v", proj.p_v, b_v)):
        out[name] = None if b is None else _block_rows(p, b[:, None])[:, 0]
    return out
