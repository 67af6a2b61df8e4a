"""A launched process for tests/engine/test_processes.py: rank 1 stays away from a collective rank 0 waits in, longer
than SLIMKIT_COLLECTIVE_TIMEOUT, so rank 0's collective fails and is reported as one line."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from slimkit.engine.processes import collective_errors, join_processes
from slimkit.primitives.errors import SlimkitError

processes = join_processes()
try:
    with collective_errors(processes):
        if processes.rank == 1:
            time.sleep(60)
        dist.all_reduce(torch.ones(2))
except SlimkitError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
