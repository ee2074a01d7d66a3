"""A periodic 'N/M MB, X MB/s' line for long saves and loads, printed by rank 0 only."""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("verl_hpc.checkpoint")

INTERVAL_S = 10.0


class Progress:
    """Counts bytes (thread-safe: the I/O thread adds, anyone reads) and logs every `interval` s."""

    def __init__(self, what: str, total_bytes: int, *, enabled: bool, interval: float = INTERVAL_S) -> None:
        self.what, self.total, self.enabled, self.interval = what, total_bytes, enabled, interval
        self.done = 0
        self.t0 = self._last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            due = self.enabled and now - self._last >= self.interval
            if due:
                self._last = now
        if due:
            log.info("%s: %s", self.what, self.line())

    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.t0, 1e-9)

    def line(self) -> str:
        return (f"{self.done / 1e6:.0f}/{self.total / 1e6:.0f} MB on this rank, "
                f"{self.rate() / 1e6:.0f} MB/s")
