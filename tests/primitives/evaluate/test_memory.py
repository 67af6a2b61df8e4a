"""primitives/evaluate/memory.py: the peak resident memory of a block, above the RSS at its start."""

from __future__ import annotations

import time

from slimkit.primitives.evaluate.memory import PeakRSS

MB = 1024 * 1024


def test_peak_rss_sees_a_block_that_touches_64_mb() -> None:
    with PeakRSS(interval=0.001) as mem:
        block = bytearray(b"\x01") * (64 * MB)  # written, so every page is resident
        deadline = time.monotonic() + 5.0  # the sampling thread may wait for a core on a loaded machine
        while mem.delta_mb < 48 and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    assert mem.start_mb > 0 and mem.peak_mb >= mem.start_mb
    assert mem.delta_mb >= 48  # 64 MB, less what the allocator may have had resident already


def test_an_idle_block_adds_little() -> None:
    with PeakRSS() as mem:
        time.sleep(0.01)
    assert 0 <= mem.delta_mb < 16
