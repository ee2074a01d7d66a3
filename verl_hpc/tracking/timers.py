"""Seconds per stage of the RL step, and throughput from token/sample counts.

    timer = StageTimer(sync=runtime_synchronize)      # sync: see below
    with timer("generate"):
        batch = rollout.generate(batch)
    ...
    metrics |= timer.pop()                             # timing_s/generate, ..., timing_s/step
    metrics |= throughput(metrics["timing_s/step"], tokens=n_tokens, samples=n_samples)

GPU work is asynchronous: without a device synchronize at the stage edges the time of one stage's
kernels is billed to whichever later stage first waits on them. The timer takes that synchronize
as a callable because only runtime/ may touch torch.cuda (docs/architecture.md); on CPU it is not needed.

With a `memory` probe (runtime/memory_peaks.py) each stage also reports its peak memory,
`mem_peak_gib/<stage>` (GPU: torch's allocated bytes; CPU: the process's resident set) and
`mem_rise_gib/<stage>` (that peak minus the memory at the stage's start: what the stage itself added,
e.g. the update's activations), the largest over the step's entries of that stage. A stage inside
another (a nested timer) gives its peak to the outer one too.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

# The stages of the RL step (trainer/programs/rl.py), in order; other names are accepted too (a recipe may add one).
# wake (the rollout's weights), sync and wake_kv (its KV cache) open a step whose rollout weights are
# stale (trainer/stages/rollout_weights.py); wake_kv runs every step (a no-op where nothing sleeps).
STAGES = ("wake", "sync", "wake_kv", "generate", "reward", "old_logprob", "ref", "prm", "update_prm", "values", "adv",
          "update_critic", "update_actor")


class StageTimer:
    def __init__(self, prefix: str = "timing_s", sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 comm: Callable[[], dict] | None = None, memory=None) -> None:
        """`comm`: a snapshot of collective counts ({(op, group): (calls, bytes)}, e.g.
        runtime.collectives.counts); given, pop() also reports the payload bytes each stage moved
        as `comm_bytes/<stage>/<op>@<group>` (and `comm_calls/...`)."""
        self.prefix = prefix
        self._comm = comm
        self._comm_totals: dict[str, float] = {}
        self._sync = sync
        self._clock = clock
        self._totals: dict[str, float] = {}
        self._step_start = clock()
        self._memory = memory
        self._open: list[list[int]] = []  # per open stage: [memory at its start, its peak so far]
        self._mem_totals: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block; a stage entered twice in one step adds up (e.g. generate per micro-batch).

        The time is recorded even when the block raises, so a step that fails half-way still
        says where it spent its time.
        """
        if self._sync is not None:
            self._sync()
        start = self._clock()
        before = self._comm() if self._comm is not None else None
        self._memory_enter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self._totals[name] = self._totals.get(name, 0.0) + (self._clock() - start)
            self._memory_exit(name)
            if before is not None:
                for (op, group), (calls, nbytes) in self._comm().items():
                    c0, b0 = before.get((op, group), (0, 0))
                    if calls > c0:
                        for kind, v in (("comm_bytes", nbytes - b0), ("comm_calls", calls - c0)):
                            key = f"{kind}/{name}/{op}@{group}"
                            self._comm_totals[key] = self._comm_totals.get(key, 0) + v

    __call__ = stage

    def _memory_enter(self) -> None:
        if self._memory is None:
            return
        self._fold(self._memory.peak())  # what the open stages reached before this one resets the window
        self._memory.reset()
        self._open.append([self._memory.current(), 0])

    def _memory_exit(self, name: str) -> None:
        if self._memory is None:
            return
        start, peak = self._open.pop()
        peak = max(peak, self._memory.peak())
        self._fold(peak)
        self._memory.reset()  # the enclosing stage goes on in a new window
        for key, value in ((f"mem_peak_gib/{name}", peak / 2**30), (f"mem_rise_gib/{name}", (peak - start) / 2**30)):
            self._mem_totals[key] = max(self._mem_totals.get(key, value), value)

    def _fold(self, peak: int) -> None:
        for frame in self._open:
            frame[1] = max(frame[1], peak)

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` just spent (validation, between two steps) out of the next `step`."""
        self._step_start += seconds

    def seconds(self, name: str) -> float:
        return self._totals.get(name, 0.0)

    def pop(self) -> dict[str, float]:
        """This step's `<prefix>/<stage>` (only stages that ran) and `<prefix>/step`; then reset.

        `step` is wall time since the previous pop (or construction), so work outside any named
        stage (data loading, logging, checkpoints) still shows up as step minus the sum of stages.
        """
        now = self._clock()
        out = {f"{self.prefix}/{name}": secs for name, secs in self._totals.items()}
        out[f"{self.prefix}/step"] = now - self._step_start
        out.update(self._comm_totals)
        out.update(self._mem_totals)
        self._comm_totals, self._mem_totals = {}, {}
        self._totals = {}
        self._step_start = now
        return out


def throughput(step_seconds: float, *, tokens: int | float | None = None,
               samples: int | float | None = None, world_size: int = 1,
               prefix: str = "perf") -> dict[str, float]:
    """tokens/s and samples/s for the whole job, plus tokens/s per GPU (the number to compare
    across cluster sizes). Nothing is returned for a step time <= 0: a rate from a zero-length
    step is an artefact of the clock, not a measurement."""
    if not step_seconds or step_seconds <= 0:
        return {}
    out: dict[str, float] = {}
    if tokens is not None:
        out[f"{prefix}/tokens_per_s"] = tokens / step_seconds
        out[f"{prefix}/tokens_per_s_per_gpu"] = tokens / step_seconds / max(int(world_size), 1)
    if samples is not None:
        out[f"{prefix}/samples_per_s"] = samples / step_seconds
    return out
