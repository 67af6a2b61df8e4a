"""A stage whose import fails (a library its package needs is not installed)."""

import slimkit_toy_plugin_missing_library  # noqa: F401
