"""Measure the extra host memory of a block of code: the peak of the process's heap in use
inside it, above its level at the start.

    with HeapPeak() as mem:
        sync(actor, rollout, bucket_mb=16)
    mem.peak_bytes      # max over the block of (heap in use now - heap in use at entry)

How: glibc's `mallinfo2()` gives the bytes the C allocator has handed out and not taken back
(small-block arenas plus mmap'ed large blocks), for the whole process, every thread included;
torch's CPU tensors, gloo's buffers and vLLM's host allocations all come from it. A sampler
thread reads it every `interval_s` (a read costs ~1 us) plus once at entry and exit. Unlike RSS
it drops the moment memory is freed (RSS keeps freed heap pages until the allocator trims
them); unlike tracemalloc it sees tensor storage. Torch ops release the GIL while they run, so
the sampler sees the moments inside a gather or a concatenation, when inputs and output coexist;
a peak shorter than the sampling interval can be missed: the figure is a lower bound that is
tight for allocations that live a millisecond or more (a tensor of several MB, written once).

Why not torch's profiler (`profile_memory=True`): it records allocations of the profiling thread
only, and a tensor that a collective backend's worker thread frees last (gloo's work objects hold
their tensors) then counts as held forever: measured, it gave 45-70 MB for the same sync.

Linux with glibc only (`available()`); elsewhere HeapPeak raises. GPU memory is not covered:
there torch's CUDA allocator statistics are the measure.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
import time
from typing import Callable, Optional


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _mallinfo2() -> Optional[Callable[[], _MallInfo2]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


def available() -> bool:
    return _mallinfo2() is not None


def heap_in_use() -> int:
    """Bytes of the C heap in use by this process now (arena blocks in use + mmap'ed blocks)."""
    fn = _mallinfo2()
    if fn is None:
        raise RuntimeError("heap_in_use needs glibc's mallinfo2 (Linux, glibc >= 2.33)")
    info = fn()
    return int(info.uordblks + info.hblkhd)


class HeapPeak:
    """Context manager; after exit: `peak_bytes` (above the entry level), `samples`, `end_bytes`
    (the level at exit above the entry level: memory the block left allocated)."""

    def __init__(self, interval_s: float = 2e-4):
        if not available():
            raise RuntimeError("HeapPeak needs glibc's mallinfo2 (Linux, glibc >= 2.33)")
        self.interval_s = interval_s
        self.base = 0
        self.peak_bytes = 0
        self.end_bytes = 0
        self.samples = 0
        self._top = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        now = heap_in_use()
        self.samples += 1
        if now > self._top:
            self._top = now

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> "HeapPeak":
        self.base = self._top = heap_in_use()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, 5e-4))  # let the sampler in between Python steps
        self._thread = threading.Thread(target=self._run, name="heap-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self.end_bytes = heap_in_use() - self.base
        self.peak_bytes = max(self._top - self.base, 0)
