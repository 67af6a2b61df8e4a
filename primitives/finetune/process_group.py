"""The process group a recovery runs in, as ``torch.distributed`` sees it: this process's rank and the group's size
(one process of rank 0 outside ``torch.distributed``). Shared by the loop, the checkpoints and the sharding.

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations


def world() -> tuple[int, int]:
    """``(rank, world size)`` of this process (``(0, 1)`` outside ``torch.distributed``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


__all__ = ["world"]
