"""Reward calls with a time limit that holds for code that ignores signals.

A reward function runs on a worker thread; the caller waits at most `timeout_s`. A call that
does not return in time is abandoned with its thread, and the next call gets a new thread:
Python cannot stop a thread, and an alarm signal can be ignored or blocked by the user's code (or
arrive in the middle of a C call). The abandoned thread is a daemon, so it never keeps the process
from exiting. Why not a process pool: a reward function receives and returns small Python
objects but may close over unpicklable state (a tokenizer, a loaded verifier), and forking a
rank that holds a vLLM engine and process groups is not safe.

Limit: a function that holds the GIL in C code forever stops the caller too; the stage watchdog
(runtime/watchdog.py) cannot run either, and the other ranks' collective timeout ends the job.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Tuple

MAX_ABANDONED = 32  # threads left running by timed-out calls before we refuse to start more


class RewardTimeout(Exception):
    """A reward call did not return within reward.timeout_s (its thread was abandoned)."""


class FunctionExited(Exception):
    """The function raised a BaseException that is not an Exception (SystemExit, a
    KeyboardInterrupt of its own, ...): kept apart so it follows reward.on_error instead of ending
    the rank, and so a real Ctrl-C on the caller's thread is never mistaken for it."""

    def __init__(self, original: BaseException):
        self.original = original
        super().__init__(f"{type(original).__name__}({original})")


class TimedCaller:
    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.abandoned = 0
        self._jobs: Optional[queue.SimpleQueue] = None

    def _start_worker(self) -> queue.SimpleQueue:
        jobs: queue.SimpleQueue = queue.SimpleQueue()

        def loop():
            while True:
                fn, args, box, done = jobs.get()
                try:
                    box.append((True, fn(*args)))
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which decides
                    box.append((False, e))
                done.set()

        threading.Thread(target=loop, name="verl_hpc-reward", daemon=True).start()
        return jobs

    def __call__(self, fn: Callable[..., Any], *args) -> Any:
        """fn(*args), or RewardTimeout after timeout_s; an exception raised by fn is re-raised here, on
        the caller's thread (a BaseException such as SystemExit as FunctionExited)."""
        if self.timeout_s <= 0:
            try:
                return fn(*args)
            except (SystemExit, GeneratorExit) as e:  # a KeyboardInterrupt here may be the user's Ctrl-C
                raise FunctionExited(e) from None
        if self.abandoned >= MAX_ABANDONED:
            raise RewardTimeout(f"{self.abandoned} earlier calls never returned; not starting another")
        if self._jobs is None:
            self._jobs = self._start_worker()
        box: list[Tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, args, box, done))
        if not done.wait(self.timeout_s):
            self._jobs, self.abandoned = None, self.abandoned + 1  # the next call gets a fresh worker
            raise RewardTimeout(f"did not return within reward.timeout_s={self.timeout_s:g}s")
        ok, value = box[0]
        if ok:
            return value
        if not isinstance(value, Exception):
            raise FunctionExited(value)
        raise value
