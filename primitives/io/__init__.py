"""Save and load compressed models: safetensors weights, HF config with ``per_layer_config``, manifest."""

from slimkit.primitives.io.load import load, read_manifest
from slimkit.primitives.io.save import MANIFEST_NAME, save, versions

__all__ = ["MANIFEST_NAME", "load", "read_manifest", "save", "versions"]
