"""The simulated clock of `bench_async.py simulate` (and the pieces simulate-elastic reuses): how
long an engine's decode steps and the trainer's steps last, and the discrete-event simulation of
colocated-synchronous and split-asynchronous RL steps. No config, no command line: numbers in,
numbers out (common.py turns a job config into these numbers).

`simulate` runs no model: a discrete-event simulation of RL steps on a simulated clock.
- Responses: lengths drawn per step from a lognormal (--len-median, --len-sigma, seeded) clipped
  at data.max_response_length; the same draws for every placement compared.
- Rollout: one vLLM engine per rollout.tp GPUs, continuous batching: an engine holds at most
  `slots` live sequences (the project's rollout.max_num_seqs, or fewer where the memory plan's KV
  cache cannot hold that many of mean length) and a waiting one takes the first free slot. One
  decode step of an engine with b live sequences holding C context tokens lasts
      alpha + beta * b + gamma * C
  alpha: reading the engine's weight shard once (bytes / the GPU's HBM bandwidth); gamma: reading
  one token's KV cache; beta: the plan's decode cost of one token (2 * parameters FLOPs at its
  decode MFU). As sequences finish the batch shrinks, and the longest ones decode nearly alone.
  Prefill is not counted.
- Training: seconds per token of the plan's forwards + updates + tensor-parallel traffic on the
  training GPUs, plus its per-step data-parallel traffic and offload copies; the weight sync is the
  plan's (verl_hpc/planning/suggest.py, step_time_parts).
- colocated-sync: all GPUs generate batch s, then train on it, then sync, in turn.
- split-async with staleness k: the rollout of batch s may start once the policy version (updates
  done) is >= s - 1 - k; the trainer trains batch s once it is generated and update s - 1 is done;
  each update is followed by the weight sync, during which the rollout GPUs stop generating (they
  load the weights; sequences in flight then continue with the new ones). k = 0 is on-policy.
Reported per k, for the best split of the GPUs (or --rollout-gpus): speedup over colocated-sync in
the same run, the idle fraction of each group (time waiting on the other), and the staleness of
each batch's oldest token, over the steps after --warmup. --out writes the same as JSON.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections import deque
from typing import Dict, List, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """Seconds of one decode step of one engine: alpha + beta * live + gamma * live context tokens."""

    alpha: float
    beta: float
    gamma: float


@dataclasses.dataclass(frozen=True)
class TrainModel:
    """Seconds of one training step: per_token * tokens in the batch + per_step."""

    per_token: float
    per_step: float

    def seconds(self, tokens: float) -> float:
        return self.per_token * tokens + self.per_step


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the clock needs of one placement: the rollout engines and the trainer."""

    engines: int
    slots: int  # live sequences per engine at most
    decode: DecodeModel
    train: TrainModel
    sync_s: float  # one weight sync, trainer -> engines
    prompt_tokens: int


@dataclasses.dataclass
class Result:
    step_s: float  # seconds per step in the window
    rollout_idle: float  # share of the rollout GPUs' time spent waiting for new weights
    train_idle: float  # share of the trainer's time spent waiting for a batch
    staleness: List[int]  # per batch in the window: trainer version - version of its oldest token

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step_s

    @property
    def mean_staleness(self) -> float:
        return float(np.mean(self.staleness))


def lognormal_lengths(steps: int, rows: int, median: float, sigma: float, max_tokens: int,
                      seed: int) -> np.ndarray:
    """[steps, rows] response lengths: lognormal around `median` (sigma 0: all equal), clipped to
    [1, max_tokens]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(math.log(median), sigma, size=(steps, rows)) if sigma > 0 else \
        np.full((steps, rows), float(median))
    return np.clip(np.rint(draws), 1, max_tokens).astype(np.int64)


class Clock:
    """The schedule the trainer makes and the engines obey: U[v] is when policy version v reaches
    the engines (U[0] = 0), pauses[v - 1] = (T_v, U_v) the sync after update v."""

    def __init__(self, staleness: int):
        self.k = staleness
        self.U: List[float] = [0.0]
        self.pauses: List[tuple] = []

    def admission(self, batch: int) -> Optional[float]:
        """When batch `batch` (1-based) may start, or None while the version it waits for is not done."""
        v = max(0, batch - 1 - self.k)
        return self.U[v] if v < len(self.U) else None

    def version_at(self, t: float) -> int:
        return bisect.bisect_right(self.U, t) - 1


class Engine:
    """One vLLM engine: continuous batching on a fluid decode-step counter `tau`."""

    def __init__(self, p: Placement, batches: List[np.ndarray]):
        self.p, self.batches = p, batches  # batches[s - 1]: this engine's lengths of batch s
        self.t = self.tau = 0.0
        self.live: List[tuple] = []  # heap of (finish tau, start tau, batch)
        self.start_sum = 0.0  # sum of the live sequences' start taus
        self.waiting: deque = deque()  # (length, batch)
        self.next_batch = 1  # the first batch not yet admitted
        self.pause_i = 0  # the first pause that may still lie ahead
        self.left = [len(b) for b in batches]
        self.done_at = [0.0] * len(batches)
        self.first_version: Dict[int, int] = {}
        self.idle: List[tuple] = []  # (from, to): nothing to generate, waiting for new weights

    # one decode step at tau lasts a + g * tau (the live set fixed)
    def _rates(self):
        b, d = len(self.live), self.p.decode
        return d.alpha + d.beta * b + d.gamma * (b * self.p.prompt_tokens - self.start_sum), d.gamma * b

    def _seconds(self, steps: float) -> float:
        a, g = self._rates()
        return steps * (a + g * self.tau) + g * steps * steps / 2

    def _steps(self, seconds: float) -> float:
        a, g = self._rates()
        b = a + g * self.tau
        return 2 * seconds / (b + math.sqrt(b * b + 2 * g * seconds))  # the root of _seconds, stably

    def _admit(self, clock: Clock) -> None:
        while self.next_batch <= len(self.batches):
            at = clock.admission(self.next_batch)
            if at is None or at > self.t:
                return
            self.waiting.extend((int(n), self.next_batch) for n in self.batches[self.next_batch - 1])
            self.next_batch += 1

    def _fill(self, clock: Clock) -> None:
        while self.waiting and len(self.live) < self.p.slots:
            n, batch = self.waiting.popleft()
            heapq.heappush(self.live, (self.tau + n, self.tau, batch))
            self.start_sum += self.tau
            self.first_version.setdefault(batch, clock.version_at(self.t))

    def _next_event(self, clock: Clock) -> tuple:
        """(time, kind) of the next thing the trainer does to this engine: a pause or an admission."""
        pauses = clock.pauses
        while self.pause_i < len(pauses) and pauses[self.pause_i][1] <= self.t:
            self.pause_i += 1
        pause = pauses[self.pause_i][0] if self.pause_i < len(pauses) else math.inf
        admit = clock.admission(self.next_batch) if self.next_batch <= len(self.batches) else None
        admit = math.inf if admit is None else admit
        return (pause, "pause") if pause <= admit else (admit, "admit")

    def _advance(self, to: float) -> None:
        """Decode until time `to`, cut short by the trainer (a fraction of a step: fluid)."""
        self.tau += self._steps(to - self.t)
        self.t = to

    def _finish_first(self) -> None:
        finish = self.live[0][0]
        self.t += self._seconds(finish - self.tau)
        self.tau = finish
        while self.live and self.live[0][0] <= self.tau + 1e-9:
            _, start, batch = heapq.heappop(self.live)
            self.start_sum -= start
            self.left[batch - 1] -= 1
            if self.left[batch - 1] == 0:
                self.done_at[batch - 1] = self.t

    def run_until_done(self, batch: int, clock: Clock) -> None:
        """Generate until this engine's share of `batch` is complete (the trainer waits for it)."""
        self._run(clock, lambda: self.left[batch - 1] == 0)

    def run_until(self, until: float, clock: Clock) -> None:
        """Generate (or wait) until time `until`: the end of the measured window."""
        self._run(clock, lambda: self.t >= until, until)

    def _run(self, clock: Clock, stop, until: float = math.inf) -> None:
        while not stop():
            self._admit(clock)
            self._fill(clock)
            at, kind = self._next_event(clock)
            if kind == "pause" and at <= self.t:  # inside a weight sync: no decoding
                self.t = clock.pauses[self.pause_i][1]
                continue
            at = min(at, until)
            if not self.live:
                assert at < math.inf, "nothing to generate and nothing to wait for"
                self.idle.append((self.t, at))
                self.t = at
            elif self.t + self._seconds(self.live[0][0] - self.tau) <= at:
                self._finish_first()
            else:
                self._advance(at)


def split_rows(lengths: np.ndarray, n: int, engines: int) -> List[List[np.ndarray]]:
    """Per engine, per step: the lengths of its prompts' n samples (prompts dealt in contiguous
    chunks, as the rollout ranks split a batch)."""
    steps, rows = lengths.shape
    chunks = np.array_split(np.arange(rows // n), engines)
    return [[lengths[s].reshape(-1, n)[c].ravel() for s in range(steps)] for c in chunks]


def _overlap(intervals, lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def simulate(p: Placement, lengths: np.ndarray, n: int, staleness: int, warmup: int,
             steps: Optional[int] = None, overlapped: bool = True) -> Result:
    """`steps` RL steps on the clock; lengths: [batches, prompts x n]. The rollout may run k + 1
    batches ahead of the trainer, so `steps` defaults to the batches less k + 1 (all of them when
    not `overlapped`: colocated, the same GPUs roll out and train in turn, the next rollout waits
    for the sync, and the groups' idle fractions are not defined: nan)."""
    k = staleness if overlapped else 0
    steps = steps or lengths.shape[0] - (k + 1 if overlapped else 0)
    assert 0 <= warmup < steps and steps + (k + 1 if overlapped else 0) <= lengths.shape[0]
    clock = Clock(k)
    engines = [Engine(p, rows) for rows in split_rows(lengths, n, p.engines)]
    waits = []
    for s in range(1, steps + 1):
        for e in engines:
            e.run_until_done(s, clock)
        ready = max(e.done_at[s - 1] for e in engines)
        start = max(ready, clock.U[-1])
        waits.append((clock.U[-1], start))
        tokens = float(lengths[s - 1].sum() + lengths.shape[1] * p.prompt_tokens)
        trained = start + p.train.seconds(tokens)
        clock.pauses.append((trained, trained + p.sync_s))
        clock.U.append(trained + p.sync_s)
    lo, hi = clock.U[warmup], clock.U[steps]
    stale = [s - 1 - min(e.first_version[s] for e in engines if s in e.first_version)
             for s in range(warmup + 1, steps + 1)]
    if not overlapped:
        return Result((hi - lo) / (steps - warmup), math.nan, math.nan, stale)
    for e in engines:  # the rollout keeps generating the batches ahead while the last step trains
        e.run_until(hi, clock)
    rollout_idle = sum(_overlap(e.idle, lo, hi) for e in engines) / (len(engines) * (hi - lo))
    return Result((hi - lo) / (steps - warmup), rollout_idle, _overlap(waits, lo, hi) / (hi - lo), stale)
