"""An elastic rollout pool on a simulated clock: the run's own rollout engines and trainer (split,
or colocated), plus backfill workers that join and leave (`bench_async.py simulate-elastic`).

    sim = ElasticSim(setup, lengths, n, target_steps, windows)   # windows: backfill.py
    out = sim.run()                                               # an Outcome

Every engine, own or backfill, pulls its work from one exactly-once book with the rules of
verl_hpc/trainer/placement/elastic/ledger.py (its `Ledger` itself): a lease is one prompt's missing samples, granted only where the engine's weights
may start the batch (version >= step - 1 - k); an engine asks for another while it has fewer than
`slots` samples live or waiting, and when work appears the least loaded engines are served first.
Membership is the pool of verl_hpc/trainer/placement/elastic/pool.py (joins, goodbyes, heartbeats).

- Decoding: model.py's engine model, unchanged: one decode step with b live sequences of C
  context tokens lasts alpha + beta * b + gamma * C (fluid: a step may be cut by an event); a
  continued sample counts its prefix in C (its prefill is not counted, as no prefill is).
- A backfill window (node, start, end): the node's worker jobs (`worker_engines` engines, decoding
  as `worker_decode` says; one pool member here for the node) start at `start`, generate from
  start + startup_s (job start, engine build, weight load; a window shorter than that is wasted)
  with the weights then current, and are preempted at `end`. On the preemption's warning signal
  they say goodbye: they report the prefixes of their samples in flight (`progress`), complete
  their leases with the samples finished, and leave the pool; the rest go back to the queue
  (continued from the prefixes, or regenerated, as the book's keep_prefixes says, i.e.
  placement.elastic.lost_samples). A `killed` worker vanishes:
  the pool reaps it after heartbeat_s, then the book takes back its open samples (regenerated,
  unless an earlier worker's prefix was kept). A `slow` worker decodes `slowdown` times slower; its
  late leases are re-dispatched after deadline_s, and whichever copy finishes first is trained.
- Training: the trainer takes batch s once the book has all of it and update s - 1 is synced;
  `placement.train.seconds(tokens)`, then the weight sync (`sync_s`), during which every engine,
  own or backfill, stops (they load the new weights). Batch s + 1 + k is wanted once update s is
  done. A worker that becomes ready during a sync joins after it, with the new weights.
- Colocated (`Setup.colocated`): the same loop with k = 0 on the run's GPUs; rollout and training
  never overlap there (the next batch needs the update), as in model.simulate.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from verl_hpc.trainer.placement.elastic.ledger import Ledger
from verl_hpc.trainer.placement.elastic.pool import Pool

from .elastic_engine import Engine

DONE, SYNC_START, SYNC_END, WINDOW, READY, END, REAP, DEADLINE = range(8)


@dataclasses.dataclass(frozen=True)
class Prefix:
    """What a leaving worker reports of a sample in flight: its tokens (only their number matters
    to the book) and the policy version of the first one."""

    tokens: range
    version: int


@dataclasses.dataclass(frozen=True)
class Setup:
    placement: Any  # model.Placement: the run's own engines, the trainer, the sync
    staleness: int
    worker_engines: int = 8  # engines a backfill window's node runs (the runtime's workers: one GPU each)
    worker_gpus: int = 8
    worker_decode: Any = None  # their decode model and slots (None: the run's own engines')
    worker_slots: int = 0
    startup_s: float = 100.0
    deadline_s: float = 600.0
    heartbeat_s: float = 60.0
    keep_prefixes: bool = True
    slowdown: float = 4.0
    colocated: bool = False


@dataclasses.dataclass
class Outcome:
    step_end: List[float]  # update s done and synced, s = 0 .. target
    staleness: List[int]  # per trained batch: trainer version - version of its oldest token
    samples_per_step: int
    trained_keys: List[Tuple[int, int, int]]  # only with record=True
    completions: int  # samples finished by engines, copies included
    accepted: int
    stats: Dict[str, int]  # the book's: redispatched, duplicates, returned, unknown_lease
    handed_back: int  # samples of leases closed by a goodbye or a reap before they were done
    generated_tokens: float
    trained_tokens: float
    train_busy_s: float  # training + syncs
    backfill_gpu_s: float  # backfill GPUs held (start-up included)
    backfill_generating_gpu_s: float  # of which, joined and able to generate
    pool: List[Tuple[float, int]]  # (time, pool size) after every join and leave
    leaves: Dict[str, int]  # leave reason -> count
    joins: int

    @property
    def end_s(self) -> float:
        return self.step_end[-1]


class Worker:
    def __init__(self, name: str, window):
        self.name, self.window = name, window
        self.engines: List[Engine] = []
        self.joined_at: Optional[float] = None


class ElasticSim:
    def __init__(self, setup: Setup, lengths: np.ndarray, n: int, target: int, windows=(), book=Ledger,
                 record: bool = False):
        p = setup.placement
        self.s, self.p, self.lengths, self.n, self.target, self.record = setup, p, lengths, n, target, record
        self.k = 0 if setup.colocated else setup.staleness
        self.rows = lengths.shape[1]
        self.prompts = self.rows // n
        assert lengths.shape[0] >= target and self.prompts * n == self.rows
        self.book = book(self.k, setup.deadline_s, setup.keep_prefixes)
        self.pool = Pool(min_workers=0, heartbeat_timeout_s=setup.heartbeat_s, lost_timeout_s=math.inf)
        self.windows = sorted(windows, key=lambda w: (w.start, w.node))
        self.events: List[tuple] = []
        self._seq = 0
        self.engines = [Engine(f"own{i}", i, p.decode, p.slots, p.prompt_tokens, 0.0, 0) for i in range(p.engines)]
        self.workers: Dict[str, Worker] = {}
        self.seeking: set = set(self.engines)  # alive, below their slots, not known to find nothing
        self.starved: set = set()
        self.deferred: List[Worker] = []
        self.version, self.syncing, self.training, self.done = 0, False, False, False
        self.U, self.stale, self.keys = [0.0], [], []
        self.ready: Dict[int, int] = {}  # complete batch -> version of its oldest token
        self.n_done = collections.Counter()
        self.leaves: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------ the event queue
    def _push(self, t: float, kind: int, arg=None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, arg))

    def _schedule(self, e: Engine) -> None:
        e.gen += 1
        if e.alive and e.live and not self.syncing:
            self._push(e.next_time(), DONE, (e, e.gen))

    def _advance(self, e: Engine, now: float) -> None:
        if not self.syncing:  # a sync stops every engine
            e.advance(now)

    # ------------------------------------------------------------------ work
    def _unstarve(self) -> None:
        """The book changed (new batch, samples back, a deadline passed): ask again."""
        self.seeking.update(e for e in self.starved if e.alive and e.load < e.slots)
        self.starved.clear()

    def _dispatch(self, now: float) -> None:
        if self.syncing or self.done:
            return
        heap = [(e.load, e.order, e) for e in self.seeking]
        heapq.heapify(heap)
        touched = set()
        while heap:
            _, order, e = heapq.heappop(heap)
            self._advance(e, now)
            leases = self.book.lease(e.name, e.version, now, 1)
            if not leases:
                self.seeking.discard(e)
                self.starved.add(e)
                continue
            for lease in leases:
                e.take(lease, self.lengths, self.n)
                self._push(lease.deadline, DEADLINE, lease.id)
            e.fill()
            touched.add(e)
            if e.load < e.slots:
                heapq.heappush(heap, (e.load, order, e))
            else:
                self.seeking.discard(e)
        for e in sorted(touched, key=lambda x: x.order):
            self._schedule(e)

    def _complete(self, e: Engine, lease_id: int) -> None:
        finished = e.leases.pop(lease_id)[1]
        self.n_done["completions"] += len(finished)
        self.n_done["accepted"] += len(self.book.complete(lease_id, finished))
        for step, rows in self.book.ready():
            self.ready[step] = min(v for row in rows for v in row)
            if self.record:
                self.keys.extend((step, i, j) for i, row in enumerate(rows) for j in range(len(row)))

    def _on_done(self, e: Engine, now: float) -> None:
        for _, _, start, key, lease_id, version, done in e.finish():
            self.n_done["tokens"] += self.lengths[key[0] - 1, key[1] * self.n + key[2]] - done
            entry = e.leases[lease_id]
            entry[0] -= 1
            entry[1][key[2]] = version
            if entry[0] == 0:
                self._complete(e, lease_id)
        e.fill()
        if e.load < e.slots and e not in self.starved:
            self.seeking.add(e)
        self._dispatch(now)
        self._schedule(e)
        self._try_train(now)

    # ------------------------------------------------------------------ the trainer
    def _try_train(self, now: float) -> None:
        s = self.version + 1
        if self.training or self.syncing or s not in self.ready or s > self.target:
            return
        tokens = float(self.lengths[s - 1].sum() + self.rows * self.p.prompt_tokens)
        self.stale.append(s - 1 - self.ready.pop(s))
        self.training = True
        seconds = self.p.train.seconds(tokens)
        self.n_done["train_busy_s"] += seconds + self.p.sync_s
        self._push(now + seconds, SYNC_START)

    def _sync_start(self, now: float) -> None:
        for e in self._alive():
            e.advance(now)
            e.gen += 1
        self.training, self.syncing = False, True
        self._push(now + self.p.sync_s, SYNC_END)

    def _sync_end(self, now: float) -> None:
        self.syncing = False
        self.version += 1
        self.U.append(now)
        if self.version >= self.target:
            self.done = True
            return
        for e in self._alive():
            e.t, e.version = max(e.t, now), self.version
        if self.version + 1 + self.k <= self.target:
            self.book.want(self.version + 1 + self.k, self.prompts, self.n)
        for w in self.deferred:
            self._join(w, now)
        self.deferred = []
        self._unstarve()
        self._dispatch(now)
        for e in self._alive():
            self._schedule(e)
        self._try_train(now)

    def _alive(self):
        return [e for e in self.engines if e.alive]

    # ------------------------------------------------------------------ the pool
    def _window(self, w, now: float) -> None:
        worker = Worker(f"n{w.node}@{w.start:.0f}", w)
        self.workers[worker.name] = worker
        if w.start + self.s.startup_s < w.end:
            self._push(w.start + self.s.startup_s, READY, worker)
        self._push(w.end, END, worker)

    def _join(self, worker: Worker, now: float) -> None:
        worker.joined_at = now
        self.pool.join(worker.name, now, node=f"n{worker.window.node}")
        slow = self.s.slowdown if worker.window.slow else 1.0
        for i in range(self.s.worker_engines):
            e = Engine(f"{worker.name}/e{i}", len(self.engines), self.s.worker_decode or self.p.decode,
                       self.s.worker_slots or self.p.slots, self.p.prompt_tokens, now, self.version, slow)
            self.engines.append(e)
            worker.engines.append(e)
            self.seeking.add(e)
        self._dispatch(now)

    def _ready(self, worker: Worker, now: float) -> None:
        if self.syncing:
            self.deferred.append(worker)
        else:
            self._join(worker, now)

    def _end(self, worker: Worker, now: float) -> None:
        if worker.joined_at is None:  # still starting (or waiting for a sync to end): nothing held
            self.deferred = [w for w in self.deferred if w is not worker]
            return
        for e in worker.engines:
            self._advance(e, now)
            e.alive = False
            e.gen += 1
            self.seeking.discard(e)
            self.starved.discard(e)
            for _, _, start, key, lease_id, version, done in e.live:  # tokens made here, kept or not
                self.n_done["tokens"] += e.tau - start - done  # (a kept prefix is whole tokens: the rest is redone)
        if worker.window.killed:  # no goodbye: the pool finds out by the missing heartbeats
            self.pool.beat(worker.name, now)
            self._push(now + self.s.heartbeat_s + 1e-6, REAP)
            return
        for e in worker.engines:
            if self.book.keep_prefixes:
                for _, _, start, key, lease_id, version, done in e.live:
                    self.book.progress(lease_id, key[2], Prefix(range(int(e.tau - start)), version))
            for lease_id in sorted(e.leases):
                entry = e.leases[lease_id]
                self.n_done["handed_back"] += entry[0]
                self._complete(e, lease_id)
            e.live, e.waiting = [], collections.deque()
        self.pool.leave(worker.name, now, "preempted: its backfill window ended")
        self.leaves["preempted"] += 1
        self._after_change(now)

    def _reap(self, now: float) -> None:
        for name in list(self.pool.members):
            if any(e.alive for e in self.workers[name].engines):
                self.pool.beat(name, now)
        for name in self.pool.reap(now):
            self.leaves["no heartbeat"] += 1
            for e in self.workers[name].engines:
                self.n_done["handed_back"] += sum(entry[0] for entry in e.leases.values())
                e.leases.clear()
                self.book.leave(e.name)
        self._after_change(now)

    def _after_change(self, now: float) -> None:
        self._unstarve()
        self._dispatch(now)
        self._try_train(now)

    # ------------------------------------------------------------------ the run
    def run(self) -> Outcome:
        for s in range(1, min(1 + self.k, self.target) + 1):
            self.book.want(s, self.prompts, self.n)
        for w in self.windows:
            self._push(w.start, WINDOW, w)
        self._dispatch(0.0)
        while not self.done:
            if not self.events:
                raise RuntimeError(f"the simulation stalled before step {self.version + 1}: nothing left to happen")
            now, _, kind, arg = heapq.heappop(self.events)
            if kind == DONE:
                e, gen = arg
                if gen == e.gen:
                    self._on_done(e, now)
            elif kind == SYNC_START:
                self._sync_start(now)
            elif kind == SYNC_END:
                self._sync_end(now)
            elif kind == WINDOW:
                self._window(arg, now)
            elif kind == READY:
                self._ready(arg, now)
            elif kind == END:
                self._end(arg, now)
            elif kind == REAP:
                self._reap(now)
            elif kind == DEADLINE and arg in self.book.open:
                self._after_change(now)
        return self._outcome()

    def _outcome(self) -> Outcome:
        end = self.U[-1]
        held = gen = 0.0
        for w in self.windows:
            if w.start < end:
                held += self.s.worker_gpus * (min(w.end, end) - w.start)
        for worker in self.workers.values():
            if worker.joined_at is not None:
                gen += self.s.worker_gpus * max(0.0, min(worker.window.end, end) - worker.joined_at)
        trained_tokens = float(self.lengths[:self.target].sum())
        return Outcome(self.U, self.stale, self.rows, self.keys, self.n_done["completions"], self.n_done["accepted"],
                       dict(self.book.stats), self.n_done["handed_back"], float(self.n_done["tokens"]), trained_tokens,
                       self.n_done["train_busy_s"], held, gen, self.pool.sizes(), dict(self.leaves),
                       sum(1 for w in self.workers.values() if w.joined_at is not None))
