"""primitives/evaluate/memory.py: the peak resident memory of a block, above the RSS at its start."""

from __future__ import annotations

import mmap
import time

from slimkit.primitives.evaluate.memory import PeakRSS

MB = 1024 * 1024


def test_peak_rss_sees_a_block_that_touches_64_mb() -> None:
    # Fresh anonymous pages from the kernel: a heap allocation could reuse memory a long test session already holds
    # resident (then the RSS does not move at all).
    with PeakRSS(interval=0.001) as mem:
        block = mmap.mmap(-1, 64 * MB)
        for offset in range(0, 64 * MB, mmap.PAGESIZE):  # written, so every page is resident
            block[offset] = 1
        deadline = time.monotonic() + 5.0  # the sampling thread may wait for a core on a loaded machine
        while mem.delta_mb < 48 and time.monotonic() < deadline:
            time.sleep(0.01)
        block.close()
    assert mem.start_mb > 0 and mem.peak_mb >= mem.start_mb
    assert mem.delta_mb >= 48  # 64 MB, less what the sampling may miss


def test_an_idle_block_adds_little() -> None:
    with PeakRSS() as mem:
        time.sleep(0.01)
    assert 0 <= mem.delta_mb < 16
