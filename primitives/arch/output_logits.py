"""Final hidden states to logits exactly as a causal LM's own forward computes them: the output head, then the
family's output transform (Granite's ``logits_scaling``, Gemma 2/3's ``final_logit_softcapping``, Cohere's
``logit_scale``, ...), as data (:data:`OUTPUT_STEPS`).

Evaluation runs the base model, then the head a few hundred rows at a time (full logits of a batch would dominate its
peak memory); :func:`output_logits` is that head. :func:`head_path` gives the base and head of a model and checks them
once against the model's own forward on a short input (:func:`matches_forward`), so a family whose transform is not
listed here is evaluated through its whole forward instead of a bare head.

Method note: docs/methods/architectures.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError

LogitOp = Literal["divide", "multiply", "softcap", "divide_hidden"]


@dataclass(frozen=True)
class LogitStep:
    """One step of a family's output transform, with its value read from the (text) config's ``key``.

    ``divide`` / ``multiply``: the logits by the value; ``softcap``: ``value * tanh(logits / value)``, skipped when the
    value is None (the forward's ``if ... is not None``); ``divide_hidden``: the hidden states by the value before the
    head (MiniCPM3). ``float32``: the forward casts the logits to float32 before the step (xLSTM, Beam); otherwise it
    runs in the head's dtype."""

    op: LogitOp
    key: str
    float32: bool = False


_SCALED = (LogitStep("divide", "logits_scaling"),)
_CAPPED = (LogitStep("softcap", "final_logit_softcapping"),)
_COHERE = (LogitStep("multiply", "logit_scale"),)

OUTPUT_STEPS: dict[str, tuple[LogitStep, ...]] = {
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid"), _SCALED
    ),
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "vaultgemma", "nanochat"), _CAPPED),
    "beam": (LogitStep("softcap", "final_logit_softcapping", float32=True),),
    "recurrent_gemma": (LogitStep("softcap", "logits_soft_cap"),),
    "xlstm": (LogitStep("softcap", "output_logit_soft_cap", float32=True),),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), _COHERE),
    "falcon_h1": (LogitStep("multiply", "lm_head_multiplier"),),
    "minicpm3": (LogitStep("divide_hidden", "logits_scaling"),),
}
"""What each causal-LM family's forward does to the head's output (transformers 5.23's ``*ForCausalLM.forward``);
a family not listed applies its head alone."""


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def output_steps(model: nn.Module) -> list[tuple[LogitStep, float]]:
    """``model``'s output transform with each step's value (steps whose value is None are left out, as the forward
    skips them); one :class:`SlimkitError` line for a value that is not a finite, positive number."""
    config = _text_config(model)
    steps: list[tuple[LogitStep, float]] = []
    for step in OUTPUT_STEPS.get(str(getattr(config, "model_type", None)), ()):
        value = getattr(config, step.key, None)
        if value is None and step.op == "softcap":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise SlimkitError(
                f"config {step.key} is {value!r}; the model's forward needs a finite positive number there"
            )
        steps.append((step, float(value)))
    return steps


def output_logits(
    model: nn.Module, hidden: torch.Tensor, steps: Sequence[tuple[LogitStep, float]] | None = None
) -> torch.Tensor:
    """The logits ``model``'s forward computes from its final hidden states ``hidden`` (the base model's output):
    its output head (``get_output_embeddings()``), then its family's output transform (``steps``: from
    :func:`output_steps` when None). The logits keep the dtype the forward gives them."""
    head = model.get_output_embeddings()
    if head is None:
        raise SlimkitError(f"{type(model).__name__} has no output head to compute logits with")
    steps = output_steps(model) if steps is None else steps
    for step, value in steps:
        if step.op == "divide_hidden":
            hidden = hidden / value
    logits = head(hidden)
    for step, value in steps:
        if step.float32:
            logits = logits.float()
        if step.op == "divide":
            logits = logits / value
        elif step.op == "multiply":
            logits = logits * value
        elif step.op == "softcap":
            logits = torch.tanh(logits / value) * value
    return logits


@dataclass(frozen=True)
class HeadPath:
    """The base model and output transform a model's logits are computed through, a few rows at a time."""

    model: nn.Module
    base: nn.Module
    steps: tuple[tuple[LogitStep, float], ...]

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states of ``ids`` (``[batch, seq, hidden]``)."""
        return self.base(ids, use_cache=False)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(self.model, hidden, self.steps)


def matches_forward(path: HeadPath, ids: torch.Tensor) -> bool:
    """Whether ``path`` gives the logits of ``path.model``'s own forward on ``ids`` (``[1, n]``), within the rounding
    of the model's dtype. The base's output is captured during the forward; a forward that calls a part of its base
    rather than the base itself (OPT's calls its decoder) has the base run on its own."""
    captured: list[Any] = []

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple | list) else getattr(output, "last_hidden_state", output))

    handle = path.base.register_forward_hook(keep)
    try:
        with torch.no_grad():
            expected = path.model(ids, use_cache=False).logits
            handle.remove()
            hidden = captured[0] if len(captured) == 1 else path.hidden(ids)
            actual = path.logits(hidden) if isinstance(hidden, torch.Tensor) else None
    except Exception:  # a model whose forward takes its base's output some other way
        return False
    finally:
        handle.remove()
    if actual is None or actual.shape != expected.shape:
        return False
    relative = 1e-4 if expected.dtype == torch.float32 else 2e-2
    expected, actual = expected.float(), actual.float()
    tolerance = relative * max(1.0, float(expected.abs().max()))
    return float((actual - expected).abs().max()) <= tolerance


def head_path(model: nn.Module, ids: torch.Tensor | None = None) -> HeadPath | None:
    """The base model and output transform of ``model``, or None when its logits must come from its whole forward:
    it has no output head or no base model of its own, or (given ``ids``, a short ``[1, n]`` input) the base and
    transform do not reproduce its forward's logits."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model or model.get_output_embeddings() is None:
        return None
    path = HeadPath(model, base, tuple(output_steps(model)))
    if ids is not None and not matches_forward(path, ids):
        return None
    return path


__all__ = ["OUTPUT_STEPS", "HeadPath", "LogitStep", "head_path", "matches_forward", "output_logits", "output_steps"]
