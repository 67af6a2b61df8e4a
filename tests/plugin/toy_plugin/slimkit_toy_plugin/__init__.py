"""A test plugin for slimkit: its stages register when their entry points are loaded."""
