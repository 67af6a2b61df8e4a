"""Architecture adapters: :class:`ModelView` over every decoder in :data:`ARCH_SPECS` (Llama's family, Gemma, Granite,
OLMo 2, Phi-3 through its fused view, the MoE families, OPT) and BERT.

:func:`check_supported` refuses other architectures (and custom-code configs) with one line.
"""

from slimkit.primitives.arch.removed import BLOCK_KINDS, BlockKind, RemovedAttention, RemovedMLP
from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec, removable_blocks
from slimkit.primitives.arch.support import SUPPORTED, check_supported
from slimkit.primitives.arch.view import BLOCK_ROLES, LINEAR_ROLES, LayerView, ModelView, NormView

__all__ = [
    "ARCH_SPECS",
    "BLOCK_KINDS",
    "BLOCK_ROLES",
    "LINEAR_ROLES",
    "SUPPORTED",
    "ArchSpec",
    "BlockKind",
    "LayerView",
    "ModelView",
    "NormView",
    "RemovedAttention",
    "RemovedMLP",
    "check_supported",
    "removable_blocks",
]
