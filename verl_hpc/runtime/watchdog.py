"""A per-rank stage watchdog: a rank stuck between collectives fails the job, naming itself.

`trainer.collective_timeout_s` catches a rank that stops answering *inside* a collective, but only
on the ranks waiting for it, and only with "timed out" as the message; a rank stuck in its own
code (a reward function that never returns, a hung file system call, an endless loop) is the one
the user must hear about. So every rank runs a daemon thread that watches its main thread:

    dog = StageWatchdog(limit_s=1800, rank=ctx.rank).start()
    dog.stage("reward")        # the trainer names what it is doing; time restarts per stage
    ...
    dog.stop()

Time spent inside torch.distributed (a collective, waiting for the others) does not count: the
thread looks at the main thread's stack (`sys._current_frames`) once a second. When the main
thread has been outside any collective, in the same stage, for longer than `limit_s`, the thread
prints `error: rank N: stalled ...` naming the stage and the code line it is stuck on, and ends
the process with exit code 16 (os._exit: the main thread cannot be interrupted from here); the
launcher (srun --kill-on-bad-exit, or the local launcher) then ends the other ranks.

The stack is read with the garbage collector off (`frame_of`): on Python 3.11 a collection
inside `sys._current_frames` could stop the whole process for good.

Limit: code that holds the GIL without releasing it (a C extension looping forever) stops this
thread too; the other ranks' collective timeout still ends such a job.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from typing import Optional

from verl_hpc.errors import VerlHpcError

log = logging.getLogger(__name__)
EXIT_CODE = 16
_COLLECTIVE_PATHS = (os.sep + os.path.join("torch", "distributed") + os.sep,)


def frame_of(thread_id: int):
    """The innermost frame of thread `thread_id` (None if it has ended), read with the garbage
    collector off. Python 3.11's sys._current_frames holds the interpreter's thread-list lock while
    it builds its dict; a collection starting there runs finalizers, and one that lets go of the GIL
    (an HTTP client's socket close: the openai client's) leaves the lock held without the GIL. A
    thread that ends then takes the GIL and waits for the lock, this thread waits for the GIL, and
    every thread of the process waits for ever (cpython issue 106883; an agent job in the suite
    stopped so, its watchdog with it). Off for the read alone: a few microseconds."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames().get(thread_id)
    finally:
        if enabled:
            gc.enable()


class StageStalledError(VerlHpcError, RuntimeError):
    """A rank spent longer than the watchdog limit in one stage outside any collective."""

    exit_code, kind = EXIT_CODE, "stalled rank"


class StageWatchdog:
    def __init__(self, limit_s: float, rank: int, poll_s: float = 1.0, exit_on_stall: bool = True):
        self.limit_s, self.rank, self.poll_s = float(limit_s), int(rank), float(poll_s)
        self.exit_on_stall = exit_on_stall
        self.stage_name = "start"
        self.stalled: Optional[str] = None  # the message, once fired (tests with exit_on_stall=False)
        self._progress = time.monotonic()
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "StageWatchdog":
        if self.limit_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verl_hpc-stage-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def stage(self, name: str) -> None:
        self.stage_name, self._progress = name, time.monotonic()

    def _where(self):
        """(in a collective?, innermost frame of our own or user code as 'file:line in fn')."""
        frame = frame_of(self._main)
        where, in_collective = "?", False
        while frame is not None:
            path = frame.f_code.co_filename
            if any(p in path for p in _COLLECTIVE_PATHS):
                in_collective = True
            if where == "?":
                where = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return in_collective, where

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            in_collective, where = self._where()
            if in_collective:  # waiting for the others is their watchdog's business
                self._progress = time.monotonic()
                continue
            stalled_s = time.monotonic() - self._progress
            if stalled_s > self.limit_s:
                self._fire(stalled_s, where)
                return

    def _fire(self, stalled_s: float, where: str) -> None:
        self.stalled = (f"rank {self.rank}: stalled for {stalled_s:.0f}s in stage '{self.stage_name}' outside any "
                        f"collective (trainer.stage_timeout_s={self.limit_s:g}); stuck at {where}")
        if not self.exit_on_stall:
            return
        print(f"error: {self.stalled}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(EXIT_CODE)


class WatchedTimer:
    """A StageTimer whose stages also tell the watchdog what the rank is doing."""

    def __init__(self, timer, watchdog: StageWatchdog):
        self.timer, self.watchdog = timer, watchdog

    def __call__(self, name: str):
        self.watchdog.stage(name)
        return self.timer(name)

    def __getattr__(self, name):
        return getattr(self.timer, name)
