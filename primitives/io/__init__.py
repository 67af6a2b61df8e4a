"""Save and load compressed models: safetensors weights, HF config with ``per_layer_config``, manifest.

:mod:`.compat` marks folders stock transformers cannot build exactly (``model_type``
``slimkit_compressed``); :mod:`.describe` says what a model holds and which loaders read a folder
(``slimkit inspect``).
"""

from slimkit.primitives.io.compat import SLIMKIT_MODEL_TYPE
from slimkit.primitives.io.describe import (
    describe_model,
    describe_source,
    folder_loaders,
    model_structure,
    saved_structure,
    structure_of,
)
from slimkit.primitives.io.load import load, read_manifest
from slimkit.primitives.io.save import MANIFEST_NAME, save, versions

__all__ = [
    "MANIFEST_NAME",
    "SLIMKIT_MODEL_TYPE",
    "describe_model",
    "describe_source",
    "folder_loaders",
    "load",
    "model_structure",
    "read_manifest",
    "save",
    "saved_structure",
    "structure_of",
    "versions",
]
