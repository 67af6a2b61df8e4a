"""Where a model runs: :mod:`.settings` (the device/dtype/memory-budget settings, :class:`.settings.Placement`),
:mod:`.moves` (moving batches to a model's device, the precision math runs in) and
:mod:`.offload` (models larger than the memory budget, offloaded by accelerate)."""
