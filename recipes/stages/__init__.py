"""Built-in stages; importing this package registers them with the stage registry.

* :mod:`.prune`: ``prune`` (model scope) and ``prune_layer`` (layer scope) over coupling groups.
* :mod:`.lowrank`: ``lowrank`` (layer scope), LoRAP's (activation-weighted) SVD of projections.
* :mod:`.prunenet`: ``prunenet`` (model scope), calibration-free policy-learned MLP pruning.
* :mod:`.lora`: ``lora`` (model scope), LoRA recovery merged into the weights.
* :mod:`.cce`: ``cce`` (model scope), coupled-components elimination: iterative evaluate-and-prune.
"""

import slimkit.recipes.stages.cce  # registers cce
import slimkit.recipes.stages.glue  # registers glue_finetune
import slimkit.recipes.stages.projection  # noqa: F401  (registers pca_project)
from slimkit.recipes.stages import lora, lowrank, prune, prunenet
from slimkit.recipes.stages.prune import TARGET_PART

__all__ = ["TARGET_PART", "lora", "lowrank", "prune", "prunenet"]
