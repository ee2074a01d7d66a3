"""Reward calls with a time limit that holds for code that ignores signals.

A reward function runs on a worker thread; the caller waits at most `timeout_s`. A call that
does not return in time is abandoned with its thread, and the next call gets a new thread:
Python cannot stop a thread, and an alarm signal can be ignored or blocked by the user's code (or
arrive in the middle of a C call). The abandoned thread is a daemon, so it never keeps the process
from exiting. Why not a process pool: a reward function receives and returns small Python
objects but may close over unpicklable state (a tokenizer, a loaded verifier), and forking a
rank that holds a vLLM engine and process groups is not safe.

A batch of calls (`call_each`) is queued on the worker at once and waited for in order, each call
still with its own limit: a hand-off per call (the caller sleeping on an event, the worker waking)
cost ~0.1 ms, most of the time scoring 128 samples with a cheap rule took.

Limit: a function that holds the GIL in C code forever stops the caller too; the stage watchdog
(runtime/watchdog.py) cannot run either, and the other ranks' collective timeout ends the job.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

MAX_ABANDONED = 32  # threads left running by timed-out calls before we refuse to start more


# Not VerlHpcErrors: outcomes the scorer turns into a score or a RewardError; no user sees them raw.
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
                fn, args, box, done, started, cancelled, stop_at_failure = jobs.get()
                if cancelled.is_set():  # behind a call that timed out (a new worker runs it) or failed
                    continue
                started.append(time.monotonic())
                try:
                    box.append((True, fn(*args)))
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which decides
                    box.append((False, e))
                    if stop_at_failure:  # set here, not by the caller: the next call must not start
                        cancelled.set()
                done.set()

        threading.Thread(target=loop, name="verl_hpc-reward", daemon=True).start()
        return jobs

    def __call__(self, fn: Callable[..., Any], *args) -> Any:
        """fn(*args), or RewardTimeout after timeout_s; an exception raised by fn is re-raised here, on
        the caller's thread (a BaseException such as SystemExit as FunctionExited)."""
        ok, value = self.call_each([(fn, args)])[0]
        if ok:
            return value
        raise value

    def call_each(self, calls: Sequence[Tuple[Callable[..., Any], tuple]],
                  stop_at_failure: bool = False) -> List[Tuple[bool, Any]]:
        """Each fn(*args) in order; per call (True, value) or (False, the exception __call__ raises:
        RewardTimeout, FunctionExited or the function's own). A call that times out abandons the
        worker; the calls after it run on a fresh one. stop_at_failure: return at the first
        failure (the calls queued after it are not started; reward.on_error=raise needs no more)."""
        out: List[Tuple[bool, Any]] = []
        if self.timeout_s <= 0:
            for fn, args in calls:
                try:
                    out.append((True, fn(*args)))
                except (SystemExit, GeneratorExit) as e:  # a KeyboardInterrupt here may be the user's Ctrl-C
                    out.append((False, FunctionExited(e)))
                except Exception as e:  # noqa: BLE001 - handed to the caller, which decides
                    out.append((False, e))
                if stop_at_failure and not out[-1][0]:
                    break
            return out
        while len(out) < len(calls) and not (stop_at_failure and out and not out[-1][0]):
            if self.abandoned >= MAX_ABANDONED:
                out.append((False, RewardTimeout(f"{self.abandoned} earlier calls never returned; "
                                                 "not starting another")))
                continue
            out.extend(self._run_on_worker(calls[len(out):], stop_at_failure))
        return out

    def _run_on_worker(self, calls, stop_at_failure: bool) -> List[Tuple[bool, Any]]:
        """Queue every call, then collect in order until the end, the first timeout or (with
        stop_at_failure) the first failure."""
        if self._jobs is None:
            self._jobs = self._start_worker()
        cancelled = threading.Event()
        queued = []
        for fn, args in calls:
            box: list[Tuple[bool, Any]] = []
            started: list[float] = []
            done = threading.Event()
            self._jobs.put((fn, args, box, done, started, cancelled, stop_at_failure))
            queued.append((box, done, started))
        out: List[Tuple[bool, Any]] = []
        for box, done, started in queued:
            # the limit counts from the call's own start (the worker notes it), not from this wait
            while not done.wait(self.timeout_s if not started else
                                max(0.0, started[0] + self.timeout_s - time.monotonic())):
                if started and time.monotonic() - started[0] >= self.timeout_s:
                    cancelled.set()  # the calls queued behind it are not run by this worker
                    self._jobs, self.abandoned = None, self.abandoned + 1  # the next call gets a fresh worker
                    out.append((False, RewardTimeout(f"did not return within reward.timeout_s={self.timeout_s:g}s")))
                    return out
            ok, value = box[0]
            out.append((ok, value if ok or isinstance(value, Exception) else FunctionExited(value)))
            if stop_at_failure and not ok:  # the worker has cancelled the rest of the batch
                return out
        return out
