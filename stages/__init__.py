"""Built-in stages; importing this package imports every module in it, which registers its stages.

``slimkit stage list`` prints them; each module's docstring describes its stages (``prune``,
``prune_layer``, ``lowrank``, ``cce``, ``prunenet``, ``lora``, ``distill``, ``pca_project``, ``pca_project_post``,
``mask_train``, ``mask_train_encoder``, ``glue_finetune``, ``reconstruct``, ``obs_prune_layer``, ``remove_blocks``,
``prune_experts``, ``merge_experts``, ``prune_expert_channels``).
:mod:`.scoring` holds what the pruning stages share (the ``scorer`` argument and the statistics a scorer reads);
:mod:`.selection_prepass` and :mod:`.lowrank_prepass` are the allocation pre-passes of the selection stages and of
``lowrank`` (which the engine reaches through ``StageArgs.allocation_prepass``), :mod:`.allocation_results` what they
decide, as the stages read it.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
