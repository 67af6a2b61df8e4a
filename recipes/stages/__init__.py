"""Built-in stages; importing this package registers them with the stage registry.

* :mod:`.prune`: ``prune`` (model scope) and ``prune_layer`` (layer scope) over coupling groups.
* :mod:`.lowrank`: ``lowrank`` (layer scope), LoRAP's (activation-weighted) SVD of projections.
* :mod:`.prunenet`: ``prunenet`` (model scope), calibration-free policy-learned MLP pruning.
* :mod:`.lora`: ``lora`` (model scope), LoRA recovery merged into the weights.
* :mod:`.cce`: ``cce`` (model scope), coupled-components elimination: iterative evaluate-and-prune.
* :mod:`.projection`: ``pca_project`` (model scope), SP3's Group PCA projection of the hidden dimension;
  ``pca_project_post`` (model scope), its post-norm encoder (BERT) counterpart.
* :mod:`.masks`: ``mask_train`` (model scope), SP3's learned masks, binarised and fused.
* :mod:`.glue`: ``glue_finetune`` (model scope), GLUE task fine-tuning.
* :mod:`.encoder_masks`: ``mask_train_encoder`` (model scope), SP3's / CoFi's masks on a BERT task model.
"""

import slimkit.recipes.stages.cce  # registers cce
import slimkit.recipes.stages.encoder_masks  # registers mask_train_encoder
import slimkit.recipes.stages.glue  # registers glue_finetune
import slimkit.recipes.stages.masks  # registers mask_train
import slimkit.recipes.stages.projection  # noqa: F401  (registers pca_project)
from slimkit.recipes.stages import lora, lowrank, prune, prunenet

__all__ = ["lora", "lowrank", "prune", "prunenet"]
