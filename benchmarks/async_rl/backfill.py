"""Backfill windows for the simulated cluster of `bench_async.py simulate-elastic`: when each node that
is not the run's own is idle, and for how long.

    windows = BackfillModel().windows(nodes=range(56), seed=0, until_s=86400)

Each such node alternates between busy (other users' jobs) and idle. An idle stretch is a window:
the elastic pool's worker jobs (preemptible array tasks kept pending, one per GPU) start on the node
when the window opens and are preempted when it closes (the node's next job arrives).

Where the shape comes from: idle-node fragments of a production supercomputer, from the data
published with BFTrainer (Z. Liu, R. Kettimuthu, M. E. Papka, I. Foster, "BFTrainer: Low-Cost
Training of Neural Networks on Unfillable Supercomputer Nodes", arXiv:2106.12091, 2021;
github.com/BFTrainer/BFTrainer, `fragments.npy`, and the node-state event log of its replayer,
github.com/dummy4binary/BFTrainer-Log-Replayer, `dataset/ndstat-10sdn6-evt.tar.gz`). The event log
holds the idle/busy state of 4,734 nodes (names of Summit's a01n01 ... h50n18 form) for 358 hours,
10-24 February 2021. Measured from it here (the idle stretches agree with fragments.npy, 411,151
fragments, to the percentile):
- 8.3% of node-time idle (time-weighted); 0.25 idle windows per node-hour;
- idle windows (423,354): median 475 s, mean 1,192 s; percentiles 10/25/75/90/99 = 91 / 162 /
  1,397 / 3,269 / 9,246 s; none shorter than 70 s (the log's resolution);
- a lognormal fits them (maximum likelihood: log-mean 6.236, log-sd 1.304, so median 511 s and
  mean 1,195 s; its 10/25/75/90/99 percentiles 96 / 212 / 1,231 / 2,717 / 10,617 s);
- busy stretches between windows: mean 12,259 s, heavy-tailed (median 2,186 s).
So here: window lengths lognormal (WINDOW_MEDIAN_S, WINDOW_SIGMA); the busy gap before each window
exponential with the mean that gives IDLE_FRACTION of node-time idle (the busy stretches' own
shape is not a lognormal and matters less: the pool's mean size is set by the idle fraction and
the window length, and 56 independent nodes smooth the rest). Each node starts a day before t = 0,
so the state at t = 0 is the stationary one.

Per window, drawn with it (so that the same windows have the same fate in every placement):
`killed`: the worker vanishes without a goodbye (SIGKILL, node lost) instead of leaving on the
preemption's warning signal; `slow`: the worker decodes SLOWDOWN times slower (a degraded or
shared node). Both are assumptions of this simulation, not of the source, and 0 turns them off.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Iterable, Iterator, List

import numpy as np

WINDOW_MEDIAN_S = 511.0  # exp(6.236)
WINDOW_SIGMA = 1.304
IDLE_FRACTION = 0.083
WARM_S = 86400.0


@dataclasses.dataclass(frozen=True)
class Window:
    node: int
    start: float
    end: float
    killed: bool = False
    slow: bool = False


@dataclasses.dataclass(frozen=True)
class BackfillModel:
    median_s: float = WINDOW_MEDIAN_S
    sigma: float = WINDOW_SIGMA
    idle_fraction: float = IDLE_FRACTION
    kill_fraction: float = 0.0
    slow_fraction: float = 0.0

    @property
    def mean_window_s(self) -> float:
        return self.median_s * math.exp(self.sigma ** 2 / 2)

    @property
    def busy_mean_s(self) -> float:
        return self.mean_window_s * (1 - self.idle_fraction) / self.idle_fraction

    def node_windows(self, node: int, seed: int) -> Iterator[Window]:
        """Node `node`'s windows in time order, from its own random stream (so adding nodes adds
        windows and changes none of the others'), the ones that end before t = 0 left out."""
        if self.idle_fraction <= 0:
            return
        rng = np.random.default_rng([seed, node])
        t = -WARM_S
        while True:
            # four draws per window whatever the fractions, so that changing one changes no window
            gap, length, kill, slow = (rng.standard_exponential(), rng.lognormal(math.log(self.median_s), self.sigma),
                                       rng.random(), rng.random())
            start = t + gap * self.busy_mean_s
            t = start + length
            if t > 0:
                yield Window(node, max(start, 0.0), t, bool(kill < self.kill_fraction), bool(slow < self.slow_fraction))

    def windows(self, nodes: Iterable[int], seed: int, until_s: float) -> List[Window]:
        """Every window of `nodes` that opens before `until_s`, in order of opening."""
        streams = [self.node_windows(node, seed) for node in nodes]
        merged = heapq.merge(*streams, key=lambda w: (w.start, w.node))
        out = []
        for w in merged:
            if w.start >= until_s:
                break
            out.append(w)
        return out


def idle_nodes(windows: List[Window], times: np.ndarray) -> np.ndarray:
    """How many nodes are idle (offered to the pool) at each of `times`."""
    starts = np.sort([w.start for w in windows])
    ends = np.sort([w.end for w in windows])
    return np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="right")
