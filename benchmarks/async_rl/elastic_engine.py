"""One vLLM engine of the simulated elastic pool (elastic_sim.py): model.Engine's continuous
batching on a fluid decode-step counter, fed by the ledger's leases instead of a fixed share of each
batch.

A decode step with b live sequences of C context tokens lasts alpha + beta * b + gamma * C; with
the live set fixed, the step at counter tau lasts a + g * tau, so the seconds to go from tau to
tau + x and its inverse are closed forms (a step may be cut by an event: fluid). A continued sample
enters with its prefix as context already (its start is put `done` steps back).
"""
from __future__ import annotations

import collections
import heapq
import math
from typing import Dict, List

import numpy as np


class Engine:
    """One vLLM engine: continuous batching on a fluid decode-step counter, as model.Engine,
    fed by leases instead of a fixed share of each batch."""

    def __init__(self, name: str, order: int, decode, slots: int, prompt_tokens: int, t: float,
                 version: int, slow: float = 1.0):
        self.name, self.order, self.slots, self.prompt = name, order, slots, prompt_tokens
        self.alpha, self.beta, self.gamma = decode.alpha * slow, decode.beta * slow, decode.gamma * slow
        self.t, self.tau, self.version = t, 0.0, version
        self.live: List[tuple] = []  # heap of (finish tau, seq, start tau, key, lease id, first version, prefix)
        self.start_sum = 0.0
        self.waiting: collections.deque = collections.deque()  # (key, lease id, tokens left, prefix, version)
        self.leases: Dict[int, list] = {}  # lease id -> [samples not finished, {sample: first version}]
        self.alive, self.gen, self._seq = True, 0, 0

    @property
    def load(self) -> int:
        return len(self.live) + len(self.waiting)

    def _rates(self):
        b = len(self.live)
        return self.alpha + self.beta * b + self.gamma * (b * self.prompt - self.start_sum), self.gamma * b

    def _seconds(self, steps: float) -> float:
        a, g = self._rates()
        return steps * (a + g * self.tau) + g * steps * steps / 2

    def advance(self, to: float) -> None:
        if to <= self.t:
            return
        if self.live:
            a, g = self._rates()
            b, s = a + g * self.tau, to - self.t
            self.tau += 2 * s / (b + math.sqrt(b * b + 2 * g * s))
        self.t = to

    def take(self, lease, lengths: np.ndarray, n: int) -> None:
        for j in lease.samples:
            pre = lease.prefixes.get(j)
            done = len(pre.tokens) if pre is not None else 0
            length = int(lengths[lease.step - 1, lease.prompt * n + j])
            self.waiting.append(((lease.step, lease.prompt, j), lease.id, length - done, done,
                                 pre.version if pre is not None else None))
        self.leases[lease.id] = [len(lease.samples), {}]

    def fill(self) -> None:
        while self.waiting and len(self.live) < self.slots:
            key, lease_id, left, done, version = self.waiting.popleft()
            start = self.tau - done  # the prefix is context already
            self._seq += 1
            heapq.heappush(self.live, (self.tau + left, self._seq, start, key, lease_id,
                                       self.version if version is None else version, done))
            self.start_sum += start

    def next_time(self) -> float:
        return self.t + self._seconds(self.live[0][0] - self.tau) if self.live else math.inf

    def finish(self) -> List[tuple]:
        """Decode to the first finishing sample; every sample finished then leaves its slot."""
        first = self.live[0][0]
        self.t += self._seconds(first - self.tau)
        self.tau = first
        out = []
        while self.live and self.live[0][0] <= self.tau + 1e-9:
            entry = heapq.heappop(self.live)
            self.start_sum -= entry[2]
            out.append(entry)
        return out
