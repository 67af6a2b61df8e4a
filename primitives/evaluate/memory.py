"""Peak resident memory of one phase of a run, measured on CPU.

``ru_maxrss`` only grows over a process's life, so it cannot tell two phases of one run apart.
:class:`PeakRSS` samples the process's resident set size (psutil) from a background thread while
the phase runs and reports the peak above the RSS at its start. Caveats, on purpose written down:
a spike shorter than the sampling interval can be missed (tensors that live through a forward or
backward pass are not that short), and memory the allocator kept from earlier phases is reused
without raising RSS, so a later phase can read lower than it would in a fresh process.
"""

from __future__ import annotations

import threading

import psutil

MB = 1024.0 * 1024.0


class PeakRSS:
    """``with PeakRSS() as mem: ...``; then ``mem.start_mb``, ``mem.peak_mb`` and ``mem.delta_mb``."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_mb = 0.0
        self.peak_mb = 0.0

    def _rss(self) -> float:
        return self._process.memory_info().rss / MB

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_mb = max(self.peak_mb, self._rss())

    def __enter__(self) -> PeakRSS:
        self.start_mb = self.peak_mb = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_mb = max(self.peak_mb, self._rss())

    @property
    def delta_mb(self) -> float:
        """Peak RSS above the RSS when the phase started."""
        return self.peak_mb - self.start_mb


__all__ = ["PeakRSS"]
