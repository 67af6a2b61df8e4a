"""Where a model's tensors live and in which precision its statistics are computed.

slimkit compresses a model on whatever device and in whatever dtype it has (CPU float32, a GPU in
bfloat16 or float16, ...). The rules every primitive follows, and the helpers they use:

* Token batches are built on the CPU (reproducible, device-independent sampling) and moved to the
  model's *input* device (:func:`input_device`: where the input embeddings live; with a model split
  over devices the first layer's inputs go there) right before the forward pass (:func:`to_input_device`).
* Statistics, Gram/covariance matrices, decompositions (SVD, eigh, Cholesky, solves), scores and the
  state of optimisers over masks, multipliers and policies are computed in float32 (or float64 where
  the math needs it) on the weights' device, whatever the weights' dtype: :func:`math_dtype` /
  :func:`upcast` give the precision of the math, never lower than float32.
* Results written back into weights take the weight's own dtype and device (``.to(weight.dtype)``); nothing
  moves the model to the CPU or casts it to float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_HALF = (torch.float16, torch.bfloat16)


def input_device(model: nn.Module) -> torch.device:
    """The device token ids must be on for ``model(ids)``: the input embeddings' (else the first parameter's)."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype of the model's weights (the input embeddings', else the first floating parameter's)."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def to_input_device(model: nn.Module, batch: Any) -> Any:
    """``batch`` (a tensor, or a mapping of tensors as a tokenizer returns) on the model's input device."""
    device = input_device(model)
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch


def math_dtype(dtype: torch.dtype, at_least: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype math on a ``dtype`` tensor runs in: never below ``at_least`` (float32 by default)."""
    if at_least == torch.float64 or dtype == torch.float64:
        return torch.float64
    return at_least if dtype in _HALF or not dtype.is_floating_point else dtype


def upcast(tensor: torch.Tensor, at_least: torch.dtype = torch.float32) -> torch.Tensor:
    """``tensor`` in :func:`math_dtype` precision on its own device (no copy when it already is)."""
    return tensor.to(math_dtype(tensor.dtype, at_least))
