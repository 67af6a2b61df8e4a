"""primitives/reconstruct/solve.py: the damped solves (Cholesky with escalating damping, then lstsq)."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.reconstruct import (
    damped_inverse,
    damped_solve,
)


def test_damped_solve_escalates_then_falls_back_to_lstsq() -> None:
    gram = torch.diag(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64))
    rhs = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    solution, info = damped_solve(rhs, gram, damping=0.0)
    assert info.method == "cholesky" and info.damping == pytest.approx(1e-9)
    torch.testing.assert_close(solution, torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64), rtol=1e-8, atol=1e-8)

    negative = -torch.eye(3, dtype=torch.float64)  # never positive definite at small damping
    solution, info = damped_solve(rhs, negative, damping=1e-3, retries=2)
    assert info.method == "lstsq" and info.damping == 1e-3
    torch.testing.assert_close(solution, rhs / (-1 + 1e-3))
    inverse, info = damped_inverse(negative, damping=0.0)
    assert info.method == "lstsq"
    torch.testing.assert_close(inverse, -torch.eye(3, dtype=torch.float64))


def test_damped_solve_damping_is_relative_to_the_diagonal() -> None:
    gram = torch.diag(torch.tensor([4.0, 2.0], dtype=torch.float64))  # mean diag 3
    solution, info = damped_solve(torch.tensor([[4.0, 2.0]], dtype=torch.float64), gram, damping=0.5)
    assert info.lam == pytest.approx(1.5)
    torch.testing.assert_close(solution, torch.tensor([[4 / 5.5, 2 / 3.5]], dtype=torch.float64))
