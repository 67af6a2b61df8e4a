"""The search: the block library, its scores and the exact selection (`slimkit.primitives.search`)."""
