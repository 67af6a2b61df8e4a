"""The language model inside a vision-language model, compressed as a causal LM; the vision tower and projector kept.

A vision-language model (``Gemma3ForConditionalGeneration``) holds a decoder whose architecture slimkit has data for
(``gemma3_text``), a vision tower and a projector. :func:`language_model` gives that decoder as the stock causal-LM
class of its type (``Gemma3ForCausalLM``) whose modules *are* the vision-language model's (nothing is copied), so every
stage compresses it as it compresses a text model; the whole model travels with it (:func:`attached`) and
:func:`slimkit.primitives.io.save.save` writes the whole model, which :func:`slimkit.primitives.io.load.load` rebuilds
as the same class. Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn


@dataclass(frozen=True)
class VisionLanguage:
    """Where a vision-language class keeps its language model, and the causal-LM class that language model is."""

    text_class: str
    """The causal-LM class of the language model's type (``Gemma3ForCausalLM``)."""
    language_model: str
    """The language model (the decoder without its head), relative to the vision-language model."""
    head: str
    """The LM head, relative to the vision-language model."""

    @property
    def prefix(self) -> str:
        """The language model's parameter prefix in the vision-language model (``model.language_model.``)."""
        return self.language_model + "."


VISION_LANGUAGE: dict[str, VisionLanguage] = {
    "Gemma3ForConditionalGeneration": VisionLanguage("Gemma3ForCausalLM", "model.language_model", "lm_head"),
}
"""Vision-language classes whose language model slimkit compresses, by class name."""

ATTACHED = "slimkit_vision_language_model"
"""The attribute (in the instance ``__dict__``, not a submodule) holding the whole model beside its language model."""

TEXT_PREFIX = "model."
"""The decoder's parameter prefix in the causal-LM class (``model.layers...``)."""


def vision_language_of(config: Any) -> VisionLanguage | None:
    """The :class:`VisionLanguage` a config (a dict or a transformers config) names in ``architectures``, or None."""
    names = config.get("architectures") if isinstance(config, Mapping) else getattr(config, "architectures", None)
    for name in names or []:
        if name in VISION_LANGUAGE:
            return VISION_LANGUAGE[name]
    return None


def language_model(model: nn.Module) -> nn.Module:
    """``model``'s language model as its causal-LM class, sharing every module (and the text config object), with
    the whole model attached; ``model`` itself when it is not a supported vision-language model."""
    spec = VISION_LANGUAGE.get(type(model).__name__)
    if spec is None:
        return model
    text_config = model.config.get_text_config()
    with torch.device("meta"):
        text = getattr(transformers, spec.text_class)(text_config)
    text.model = model.get_submodule(spec.language_model)
    text.lm_head = model.get_submodule(spec.head)
    text.config = text_config
    text.__dict__[ATTACHED] = model  # not a submodule: its vision parameters stay out of the text model's
    return text.eval()


def attached(model: nn.Module) -> nn.Module | None:
    """The whole vision-language model a language model (from :func:`language_model`) belongs to, or None."""
    found = model.__dict__.get(ATTACHED)
    return found if isinstance(found, nn.Module) else None


def text_names(shapes: Mapping[str, tuple[int, ...]], spec: VisionLanguage) -> dict[str, tuple[int, ...]]:
    """The language model's tensors of a vision-language checkpoint under the causal-LM class's names
    (``model.language_model.layers.0...`` -> ``model.layers.0...``; the head's name is the same)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if name.startswith(spec.prefix):
            out[TEXT_PREFIX + name[len(spec.prefix) :]] = shape
        elif name.startswith(spec.head + "."):
            out[name] = shape
    return out


__all__ = [
    "ATTACHED",
    "TEXT_PREFIX",
    "VISION_LANGUAGE",
    "VisionLanguage",
    "attached",
    "language_model",
    "text_names",
    "vision_language_of",
]
