"""Routed experts as units: the routed output as a pure function, removing and merging experts, scoring kept sets.

See ``docs/methods/moe-experts.md``.
"""

from slimkit.primitives.experts.routed import ExpertWeights, expert_outputs, routed_output, routing
from slimkit.primitives.experts.surgery import keep_experts, kept_weights

__all__ = ["ExpertWeights", "expert_outputs", "keep_experts", "kept_weights", "routed_output", "routing"]
