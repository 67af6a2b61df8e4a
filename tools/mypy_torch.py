"""A mypy plugin for torch's ``nn.Module.__getattr__``.

torch's stubs type every attribute a module does not declare (``model.config``, ``layer.self_attn``, a registered
buffer) as ``Tensor | Module``, the return type of ``nn.Module.__getattr__``, so every use of a Hugging Face model's
attributes would need a cast. This plugin types exactly those fallback lookups as ``Any``; attributes a class
declares keep their types, and everything else is checked as usual.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.plugin import AttributeContext, Plugin
from mypy.types import AnyType, Instance, Type, TypeOfAny, UnionType, get_proper_type

FALLBACK = frozenset({"torch._tensor.Tensor", "torch.nn.modules.module.Module"})


def _is_module_fallback(attribute_type: Type) -> bool:
    proper = get_proper_type(attribute_type)
    if not isinstance(proper, UnionType):
        return False
    names = {getattr(get_proper_type(item), "type", None) for item in proper.items}
    return {name.fullname for name in names if name is not None} == FALLBACK and all(
        isinstance(get_proper_type(item), Instance) for item in proper.items
    )


def _any_for_fallback(ctx: AttributeContext) -> Type:
    if _is_module_fallback(ctx.default_attr_type):
        return AnyType(TypeOfAny.special_form)
    return ctx.default_attr_type


class TorchModulePlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        return _any_for_fallback


def plugin(version: str) -> type[Plugin]:
    return TorchModulePlugin
