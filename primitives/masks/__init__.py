"""Learned structured masks (SP3, CoFi): hard-concrete gates trained with a Lagrangian sparsity target.

* :mod:`.gates`: hard-concrete (L0) gates; :mod:`.mask_set`: SP3's dimension / head / layer masks
  (:class:`MaskSet`); :mod:`.hooks`: masks applied to a Hugging Face model by hooks (:func:`apply_masks`).
* :mod:`.sparsity`: expected sparsity, the Lagrangian and the final threshold (:func:`binarize`);
  :mod:`.schedule`: the multi-stage schedule (:class:`MaskSchedule`).
* :mod:`.training`: the mask-training loop both model kinds share; :mod:`.stream`: decoder LLMs
  (:func:`~.stream.train_stream_masks`, fused by :mod:`.fusing`); :mod:`.encoder`: post-norm encoders on a
  GLUE task (:func:`~.encoder.train_encoder_masks`).
"""

from __future__ import annotations

from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MaskSet, MaskShape, MaskValues
from slimkit.primitives.masks.schedule import MaskSchedule
from slimkit.primitives.masks.sparsity import binarize

__all__ = ["MaskSchedule", "MaskSet", "MaskShape", "MaskValues", "apply_masks", "binarize"]
