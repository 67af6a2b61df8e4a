"""The architecture data of every dense decoder agrees with the couplings torch-pruning traces in its forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slimkit.primitives.arch import spec as spec_module
from slimkit.primitives.groups.traced_check import trace_differences
from tests.tiny import DECODERS

FUSED_MLP = {"phi3", "glm4"}
"""Gate and up held as one matrix split with ``chunk``: the trace cannot express the MLP group (its data is
``ArchSpec.fused``, checked by the fused view's output-equality tests)."""


def _ids() -> torch.Tensor:
    return torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_spec_couplings_equal_the_traced_ones(family):
    lines = trace_differences(DECODERS[family](layers=2), _ids())
    if family in FUSED_MLP:
        assert lines == ["layer 0 MLP: not traced", "layer 1 MLP: not traced"]
    else:
        assert lines == []


def test_a_norm_missing_from_the_data_is_found(monkeypatch):
    """OLMo 3's data without its attention post-norm: the traced stream holds that norm, the spec's does not."""
    wrong = replace(spec_module.ARCH_SPECS["olmo3"], attn_out_norm=None)
    monkeypatch.setitem(spec_module.ARCH_SPECS, "olmo3", wrong)
    (line,) = trace_differences(DECODERS["olmo3"](layers=1), _ids())
    assert line.startswith("residual stream: only in the spec [], only in the trace ")
    assert "model.layers.0.post_attention_layernorm.weight" in line
