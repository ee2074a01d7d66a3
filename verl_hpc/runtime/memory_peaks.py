"""Peak memory over a window of the step (a stage): the GPU's (torch's allocator) where there is one,
the process's resident set on a CPU.

    probe = memory_peaks.probe()
    probe.reset(); start = probe.current()
    ...                                       # the stage
    peak, rise = probe.peak(), probe.peak() - start

On a GPU the window is torch's own (reset_peak_memory_stats / max_memory_allocated). On a CPU the
kernel keeps the process's resident high-water mark (VmHWM in /proc/self/status) and starts it again
from the current resident set when "5" is written to /proc/self/clear_refs (Linux >= 4.0, the
process's owner). That also lowers what getrusage(ru_maxrss) reports afterwards, so the probe keeps
the whole run's high-water mark itself: `process_peak_bytes()` is what the job's summary reports.
Nothing else measures this: psutil and tracemalloc see the current RSS or Python's own allocations,
not the peak of the resident set between two points (torch's CPU allocator keeps no statistics).
"""
from __future__ import annotations

import logging
import resource
from typing import Optional

from verl_hpc.runtime.device import has_gpu, memory_allocated, peak_memory_allocated, reset_peak_memory

log = logging.getLogger(__name__)

_STATUS, _CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"
_run_peak = 0  # the process's resident high-water mark before the last reset (bytes)


def _status_kib(field: str) -> int:
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{_STATUS} has no {field}")


class HostPeaks:
    """The process's resident set: current, and its peak since the last reset."""

    def current(self) -> int:
        return _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        return _status_kib("VmHWM") * 1024

    def reset(self) -> None:
        global _run_peak
        _run_peak = max(_run_peak, self.peak())
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")


class DevicePeaks:
    """torch's allocated bytes on this rank's GPU: current, and their peak since the last reset."""

    def current(self) -> int:
        return memory_allocated() or 0

    def peak(self) -> int:
        return peak_memory_allocated() or 0

    def reset(self) -> None:
        reset_peak_memory()


def probe():
    """The window for this machine: the GPU's with one; else the resident set's where this kernel
    lets the process reset its high-water mark; None (no per-stage figures, said once) where not."""
    if has_gpu():
        return DevicePeaks()
    host = HostPeaks()
    try:
        host.reset()
        host.current()
    except OSError as e:
        log.info("no per-stage memory peaks on this machine (%s: %s)", _CLEAR_REFS, e)
        return None
    return host


def process_peak_bytes() -> int:
    """The process's resident high-water mark over its whole life, resets included."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        now: Optional[int] = HostPeaks().peak()
    except OSError:
        now = None
    return max(_run_peak, maxrss, now or 0)
