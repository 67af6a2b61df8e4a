"""A model config as one module reads it, with a few values of its own (a layer's head counts).

Some attention forwards read head counts from ``self.config`` (shared by every layer) instead of their own
attributes: Phi-3 splits ``qkv_proj`` at ``config.num_attention_heads * head_dim``. After per-layer pruning, each
such module gets a :class:`LayerConfig`: its own values for the keys named in ``ArchSpec.head_config_keys``, every
other attribute read from (and written to) the model's config, so later changes there (the attention
implementation) still reach it.

Method note: docs/methods/architectures.md.
"""

from __future__ import annotations

from typing import Any


class LayerConfig:
    """``base`` with ``own`` values in front: reads of an own key give its value, every other read is ``base``'s."""

    def __init__(self, base: Any, own: dict[str, Any]) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_own", dict(own))

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__  # absent while copy/pickle rebuild the object: no recursion
        if "_own" not in state:
            raise AttributeError(name)
        if name in state["_own"]:
            return state["_own"][name]
        return getattr(state["_base"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._own:
            self._own[name] = value
        else:
            setattr(self._base, name, value)

    @property
    def base(self) -> Any:
        """The model's config this one reads through."""
        return self._base

    @property
    def own(self) -> dict[str, Any]:
        return dict(self._own)

    def __repr__(self) -> str:
        return f"LayerConfig({type(self._base).__name__}, own={self._own})"


def with_own_values(config: Any, own: dict[str, Any]) -> LayerConfig:
    """A :class:`LayerConfig` over ``config``'s base (``config`` itself unless it is one) with ``own`` values."""
    base = config.base if isinstance(config, LayerConfig) else config
    return LayerConfig(base, own)


__all__ = ["LayerConfig", "with_own_values"]
