"""Architecture adapters: :class:`ModelView` over llama-family (incl. GQA, Qwen2, Mistral), OPT and BERT."""

from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec
from slimkit.primitives.arch.view import LINEAR_ROLES, LayerView, ModelView, NormView

__all__ = ["ARCH_SPECS", "LINEAR_ROLES", "ArchSpec", "LayerView", "ModelView", "NormView"]
