"""Random-weight models of a given config, made on the meta device and materialised on the target device in the
target dtype, never at full size anywhere else: cost benchmarks at real shapes without the real weights.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

from typing import Any


def random_model(config: Any, dtype: str, device: str = "cpu", seed: int = 0) -> Any:
    """A causal LM of ``config`` in ``dtype`` on ``device``: norms 1, biases 0, every other weight drawn from
    N(0, 0.02) by a generator seeded with ``seed``; tied weights tied; the rotary frequencies computed."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.tie_weights()
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:  # buffers the meta device left empty: a fresh module computes them
        model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    return model
