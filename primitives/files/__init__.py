"""Files slimkit writes: :mod:`.atomic` (staged, replaced in one step, leftovers cleaned) and :mod:`.lock`
(one writer per output)."""
