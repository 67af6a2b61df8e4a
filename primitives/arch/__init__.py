"""Architecture adapters: :class:`ModelView` over llama-family (Llama incl. GQA, Mistral, Qwen2, Qwen3), OPT and BERT.

:func:`check_supported` refuses other architectures (and custom-code configs) with one line.
"""

from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec
from slimkit.primitives.arch.support import SUPPORTED, check_supported
from slimkit.primitives.arch.view import LINEAR_ROLES, LayerView, ModelView, NormView

__all__ = [
    "ARCH_SPECS",
    "LINEAR_ROLES",
    "SUPPORTED",
    "ArchSpec",
    "LayerView",
    "ModelView",
    "NormView",
    "check_supported",
]
