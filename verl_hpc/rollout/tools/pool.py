"""Tool calls of many episodes at once, on worker threads, each with a time limit.

    pool = ToolPool.from_config(cfg.multi_turn, registry, cpus_per_task=cfg.slurm.cpus_per_task)
    outcomes = pool.run([(offered_tools, call), ...])   # one ToolOutcome per call, in order
    pool.close()

Threads, not processes: the python tool's work happens in sandbox processes, which a thread only
waits for, and the calculator is microseconds; user tools may close over unpicklable state. All
the calls given to one `run` are queued at once and run `workers` at a time.

Nothing a tool does raises out of `run`: an unknown tool, a tool not offered to the episode,
arguments the function's signature refuses, an exception or a timeout each become an outcome whose
text is the observation the model reads ("error: ...") and whose `error` says which, for the
metrics.

A call past `timeout_s` is abandoned with its thread (Python cannot stop a thread) and a fresh
worker takes its place. Workers are daemon threads, unlike concurrent.futures' (which the
interpreter joins at exit), so a tool that never returns cannot keep the rank from exiting. After
MAX_ABANDONED calls still running past their limit, further calls are not started.
"""
from __future__ import annotations

import inspect
import queue
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from verl_hpc.rollout.tools.calls import ToolCall, ToolFailed

MAX_ABANDONED = 32  # abandoned calls still running before new calls are refused
ERRORS = ("unknown_tool", "not_offered", "bad_arguments", "tool_error", "timeout")


@dataclass
class ToolOutcome:
    text: str  # what the model reads
    ok: bool
    error: Optional[str]  # one of ERRORS, None when ok
    seconds: float
    name: str


class _Job:
    def __init__(self, offered: Sequence[str], call: ToolCall):
        self.offered, self.call = offered, call
        self.started: Optional[float] = None
        self.outcome: Optional[ToolOutcome] = None
        self.abandoned = False
        self.done = threading.Event()


class ToolPool:
    def __init__(self, registry, workers: int, timeout_s: float, max_output_chars: int):
        self.registry = registry
        self.workers = max(int(workers), 1)
        self.timeout_s = float(timeout_s)
        self.max_output_chars = int(max_output_chars)
        self._queue: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._lock = threading.Lock()  # a job's finish and its abandonment must not cross
        self.abandoned_running = 0
        self._closed = False
        for _ in range(self.workers):
            self._start_worker()

    @classmethod
    def from_config(cls, multi_turn, registry, *, cpus_per_task: int) -> "ToolPool":
        """The pool of the multi_turn section's tool workers; cpus_per_task: slurm.cpus_per_task."""
        mt = multi_turn
        return cls(registry, mt.workers(cpus_per_task), mt.tool_timeout_s, mt.max_tool_output_chars)

    def run(self, calls: Sequence[Tuple[Sequence[str], ToolCall]]) -> List[ToolOutcome]:
        if self._closed:
            raise RuntimeError("ToolPool.run after close()")
        jobs = []
        for offered, call in calls:
            job = _Job(offered, call)
            if self.abandoned_running >= MAX_ABANDONED:
                job.outcome = _failed(call.name, "timeout", f"error: not run: {self.abandoned_running} earlier "
                                                            "tool calls never returned", 0.0)
            else:
                self._queue.put(job)
            jobs.append(job)
        return [job.outcome if job.outcome is not None else self._wait(job) for job in jobs]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for _ in range(self.workers):
                self._queue.put(None)

    def __enter__(self) -> "ToolPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ workers
    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name="verl_hpc-tool", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.started = time.monotonic()
            outcome = self._call(job.offered, job.call, job.started)
            with self._lock:
                job.outcome = outcome
                job.done.set()
                if job.abandoned:  # a fresh worker took this one's place when the call timed out
                    self.abandoned_running -= 1
                    return

    def _wait(self, job: _Job) -> ToolOutcome:
        """The job's outcome, or a timeout outcome once it has run timeout_s (counted from its own
        start: a call queued behind busy workers is not charged for the wait)."""
        while True:
            started = job.started
            left = self.timeout_s if started is None else started + self.timeout_s - time.monotonic()
            if job.done.wait(max(left, 0.0)):
                return job.outcome
            if job.started is not None and time.monotonic() - job.started >= self.timeout_s:
                with self._lock:
                    if job.done.is_set():  # it finished just now
                        return job.outcome
                    job.abandoned = True
                    self.abandoned_running += 1
                self._start_worker()
                return _failed(job.call.name, "timeout", f"error: {job.call.name} did not finish within "
                               f"{self.timeout_s:g} s and was abandoned", time.monotonic() - job.started)

    # ------------------------------------------------------------------ one call
    def _call(self, offered: Sequence[str], call: ToolCall, started: float) -> ToolOutcome:
        def failed(error: str, text: str) -> ToolOutcome:
            return _failed(call.name, error, self._cut(text), time.monotonic() - started)

        tool = self.registry.get(call.name)
        if tool is None:
            return failed("unknown_tool", f"error: unknown tool {call.name!r}; tools offered: {_listed(offered)}")
        if call.name not in offered:
            return failed("not_offered", f"error: tool {call.name!r} is not offered here; tools offered: "
                                         f"{_listed(offered)}")
        try:
            bound = inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as e:
            return failed("bad_arguments", f"error: bad arguments for {call.name}: {e}; expected "
                                           f"{call.name}{inspect.signature(tool.fn)}")
        try:
            value = tool.fn(*bound.args, **bound.kwargs)
            text = value if isinstance(value, str) else str(value)
        except ToolFailed as e:  # the tool wrote the whole observation itself
            return failed("tool_error", str(e))
        except BaseException as e:  # noqa: BLE001 - a worker thread: even SystemExit is the tool's failure
            return failed("tool_error", f"error: {type(e).__name__}: {e}")
        return ToolOutcome(self._cut(text), True, None, time.monotonic() - started, call.name)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return (text[:self.max_output_chars] +
                f"\n[output cut: {len(text) - self.max_output_chars} more characters not shown]")


def _failed(name: str, error: str, text: str, seconds: float) -> ToolOutcome:
    return ToolOutcome(text, False, error, seconds, name)


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names) or "none"
