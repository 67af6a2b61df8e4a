"""The scoring term of pruning plans (stages/scoring.py ``scoring_bytes``, ``with_scoring``): the largest scored weight
in three float32 copies, counted where it is larger than what it follows."""

from __future__ import annotations

from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.device.memory_model import ModelShape, StageMemory
from slimkit.stages.cce import CceArgs
from slimkit.stages.prune import PruneArgs
from slimkit.stages.scoring import scoring_bytes, with_scoring

SHAPE = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10, tied=True)
"""An MLP matrix is 4 x 8 = 32 parameters; the embedding 10 x 4 = 40."""


def test_the_scoring_term_by_hand():
    assert scoring_bytes(SHAPE, ["mlp_channel"]) == 3 * 32 * 4 == 384
    assert scoring_bytes(SHAPE, ["attention_head", "hidden_feature"]) == 3 * 40 * 4 == 480
    mlp = scoring_bytes(SHAPE, ["mlp_channel"])
    small = with_scoring(StageMemory("s", {"activations": 100, "sums": 7}), mlp, ["activations"])
    assert small.parts == {"sums": 7, "activations or scoring": 384}
    large = with_scoring(StageMemory("s", {"activations": 1000}), mlp, ["activations"])
    assert large.parts == {"activations": 1000}
    assert with_scoring(StageMemory("s"), mlp, ["activations"]).parts == {"scoring": 384}


def test_weight_only_scorers_plan_their_scoring():
    """magnitude reads no data (no activations): its plan is the scoring alone, for prune and for cce alike."""
    inputs = MemoryInputs(SHAPE, None, 4)
    assert PruneArgs(scorer="magnitude").memory("prune", inputs).parts == {"scoring": 384}
    assert CceArgs(scorer="magnitude", kinds=["hidden_feature"]).memory("cce", inputs).parts == {"scoring": 480}
