"""The elastic rollout ledger's rules, indexed for the simulated cluster (`bench_async.py
simulate-elastic`).

    book = IndexedLedger(staleness=k, deadline_s=600, keep_prefixes=True)   # Ledger's constructor
    book.want(step, prompts, n); book.lease(worker, version, now, max_groups)
    book.progress(lease_id, j, prefix); book.complete(lease_id, {j: sample}); book.leave(worker)
    book.ready()

The same calls, answers and counters as verl_hpc/trainer/placement/elastic/ledger.py's `Ledger`
(leases of one prompt's missing samples, oldest batch first, under the staleness rule; a lease
past its deadline re-dispatched while it stays open, the first completion of a sample kept and a
later copy counted as a duplicate; a worker that leaves hands its open samples back, with their
prefixes under keep_prefixes). The Ledger keeps its open leases indexed by group (handing out the
768 groups of three 256-prompt x 8 batches: ~0.6 s of CPU; it was ~115 s when every sample was
checked against every open lease) but still walks every open group on each call, and the
simulation makes hundreds of thousands of calls. This book keeps the same state behind three
indexes: the open leases of each sample, the groups that may have a free sample (sorted by step and
prompt), and the open leases by deadline. Folding them into the Ledger, so that one book serves
both, is left to do. tests/unit/test_elastic_sim.py drives both with the same random calls and the whole
simulation with both, and checks that every answer is the same.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Dict, List, Set, Tuple

from verl_hpc.trainer.placement.elastic.ledger import Lease

Group = Tuple[int, int]  # (step, prompt)


class _Batch:
    __slots__ = ("step", "prompts", "n", "done")

    def __init__(self, step: int, prompts: int, n: int):
        self.step, self.prompts, self.n = step, prompts, n
        self.done: Dict[Tuple[int, int], object] = {}

    def complete(self) -> bool:
        return len(self.done) == self.prompts * self.n


class IndexedLedger:
    def __init__(self, staleness: int, deadline_s: float, keep_prefixes: bool = True):
        self.k, self.deadline_s, self.keep_prefixes = staleness, deadline_s, keep_prefixes
        self.batches: Dict[int, _Batch] = {}
        self.open: Dict[int, Lease] = {}
        self.prefix: Dict[Tuple[int, int, int], object] = {}
        self._ids = itertools.count(1)
        self.stats = {"redispatched": 0, "duplicates": 0, "returned": 0, "unknown_lease": 0}
        self.per_worker: Dict[str, int] = {}
        self._holders: Dict[Tuple[int, int, int], List[Lease]] = {}  # sample -> its open leases
        self._by_worker: Dict[str, Set[int]] = {}
        self._candidates: List[Group] = []  # sorted; a superset of the groups with a free sample
        self._in_candidates: Set[Group] = set()
        self._deadlines: List[Tuple[float, int]] = []  # heap of (deadline, lease id), open or not

    # ------------------------------------------------------------------ indexes
    def _offer(self, group: Group) -> None:
        if group not in self._in_candidates:
            self._in_candidates.add(group)
            bisect.insort(self._candidates, group)

    def _expire(self, now: float) -> None:
        """Leases whose deadline has passed no longer hold their samples: their groups may be free."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self.open.get(lease_id)
            if lease is not None:
                self._offer((lease.step, lease.prompt))

    def _close(self, lease: Lease) -> None:
        for j in lease.samples:
            key = (lease.step, lease.prompt, j)
            holders = [other for other in self._holders[key] if other is not lease]  # by identity: fast
            if holders:
                self._holders[key] = holders
            else:
                del self._holders[key]
        self._by_worker[lease.worker].discard(lease.id)
        self._offer((lease.step, lease.prompt))  # its undone samples (if any) are free again

    # ------------------------------------------------------------------ what is wanted
    def want(self, step: int, prompts: int, n: int) -> None:
        if step in self.batches:
            raise ValueError(f"batch {step} is already wanted")
        self.batches[step] = _Batch(step, prompts, n)
        for i in range(prompts):
            self._offer((step, i))

    def _free(self, group: Group, worker: str, now: float):
        """(samples free for `worker`, whether any was held before, whether any is free for anyone)."""
        step, prompt = group
        batch = self.batches.get(step)
        if batch is None:
            return [], False, False
        free, again, anyone = [], False, False
        for j in range(batch.n):
            if (prompt, j) in batch.done:
                continue
            held = self._holders.get((step, prompt, j), ())
            live = [lease for lease in held if lease.deadline > now]
            anyone |= not live
            if not live and not any(lease.worker == worker for lease in held):
                free.append(j)
                again |= bool(held)
        return free, again, anyone

    # ------------------------------------------------------------------ handing out work
    def lease(self, worker: str, version: int, now: float, max_groups: int = 1) -> List[Lease]:
        self._expire(now)
        out, i = [], 0
        while i < len(self._candidates) and len(out) < max_groups:
            group = self._candidates[i]
            samples, again, anyone = self._free(group, worker, now)
            if not samples:
                if not anyone:  # nothing here for anybody until a lease closes or expires
                    del self._candidates[i]
                    self._in_candidates.discard(group)
                    continue
                i += 1
                continue
            step, prompt = group
            if version < step - 1 - self.k:
                break  # later batches need newer weights still
            prefixes = {j: self.prefix[(step, prompt, j)] for j in samples if (step, prompt, j) in self.prefix}
            lease = Lease(next(self._ids), worker, step, prompt, tuple(samples), version, now + self.deadline_s,
                          prefixes)
            self.open[lease.id] = lease
            for j in samples:
                self._holders.setdefault((step, prompt, j), []).append(lease)
            self._by_worker.setdefault(worker, set()).add(lease.id)
            heapq.heappush(self._deadlines, (lease.deadline, lease.id))
            if again:
                self.stats["redispatched"] += len(samples)
            out.append(lease)
            if not self._free(group, "", now)[2]:  # leased whole: drop it until something changes
                del self._candidates[i]
                self._in_candidates.discard(group)
        return out

    def progress(self, lease_id: int, sample: int, prefix) -> None:
        lease = self.open.get(lease_id)
        if lease is not None and self.keep_prefixes and sample in lease.samples:
            key = (lease.step, lease.prompt, sample)
            old = self.prefix.get(key)
            if old is None or len(prefix.tokens) > len(old.tokens):
                self.prefix[key] = prefix

    def complete(self, lease_id: int, samples: Dict[int, object]) -> List[int]:
        lease = self.open.pop(lease_id, None)
        if lease is None:
            self.stats["unknown_lease"] += 1
            return []
        self._close(lease)
        batch, accepted = self.batches.get(lease.step), []
        for j, sample in samples.items():
            if batch is None or j not in lease.samples or (lease.prompt, j) in batch.done:
                self.stats["duplicates"] += 1
                continue
            batch.done[(lease.prompt, j)] = sample
            self.prefix.pop((lease.step, lease.prompt, j), None)
            accepted.append(j)
        self.per_worker[lease.worker] = self.per_worker.get(lease.worker, 0) + len(accepted)
        return accepted

    def leave(self, worker: str) -> int:
        returned = 0
        for lease_id in sorted(self._by_worker.get(worker, ())):
            lease = self.open.pop(lease_id)
            self._close(lease)
            batch = self.batches.get(lease.step)
            for j in lease.samples:
                if batch is not None and (lease.prompt, j) not in batch.done:
                    returned += 1
                    if not self.keep_prefixes:
                        self.prefix.pop((lease.step, lease.prompt, j), None)
        self.stats["returned"] += returned
        return returned

    # ------------------------------------------------------------------ what is finished
    def ready(self) -> List[Tuple[int, List[List[object]]]]:
        out = []
        for step in sorted(self.batches):
            b = self.batches[step]
            if not b.complete():
                break
            out.append((step, [[b.done[(i, j)] for j in range(b.n)] for i in range(b.prompts)]))
            del self.batches[step]
        return out

    def oldest_open(self):
        return min(self.batches) if self.batches else None
