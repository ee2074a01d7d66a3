"""The exactly-once book of an elastic rollout pool: which samples each batch wants, which worker
holds each one (a lease, until a deadline), and which are done.

    ledger = Ledger(staleness=k, deadline_s=120, keep_prefixes=True)
    ledger.want(step, num_prompts, n)                      # batch `step` (trained at step `step`)
    leases = ledger.lease("w3", version=v, now=t, max_groups=4)
    ledger.progress(lease.id, j, sample)                   # a chunk's prefix (optional)
    accepted = ledger.complete(lease.id, {j: sample}, now)  # first completion of a sample wins
    ledger.leave("w3")                                     # its open samples go back to the queue
    for step, samples in ledger.ready(): ...               # whole batches, in step order

The unit handed out is one prompt's missing samples (its group), so that a worker prefills the
prompt once for all of them. A lease is granted only where the worker's weights may start the
batch (the staleness rule of split placement: version >= step - 1 - k). A lease past its deadline
is a straggler: its missing samples are leased again to the next worker that asks, while the first
lease stays open; whichever completes a sample first is kept and a later copy is dropped (counted),
so a slow worker and its replacement never put one sample into training twice, and a lost worker
never takes one away. A worker that leaves hands its open samples back at once; with
`keep_prefixes` the tokens it reported (`progress`) go with them and the next worker continues the
prefix, else they are generated again. Samples are seeded by (step, prompt, sample), not by worker,
so a regenerated sample under the same weights is the sample that was lost.

Pure bookkeeping (no clocks, no I/O): the caller passes `now`, so that tests and the simulated
cluster drive it with their own time. The state sits behind three indexes, because each call would
otherwise walk every sample of every open batch and the simulated cluster makes hundreds of
thousands of calls (3 batches of 256 prompts x 8 samples handed out: 24 s of CPU with a scan of
every open lease per sample, well under a second indexed): the open leases of each sample, the
groups that may have a free sample (sorted by step and prompt), and the open leases by deadline.
tests/elastic_naive_ledger.py holds the same rules as plain scans, and tests drive both with the
same random calls. Written here: work-queue libraries (Celery, Dask, Ray) bring
a broker or a scheduler process, which a Slurm run on a shared filesystem does not have.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from typing import Dict, List, Optional, Set, Tuple

from verl_hpc.trainer.placement.inflight import Sample

Key = Tuple[int, int, int]  # (step, prompt, sample)
Group = Tuple[int, int]  # (step, prompt)


@dataclasses.dataclass(frozen=True)
class Lease:
    id: int
    worker: str
    step: int
    prompt: int
    samples: Tuple[int, ...]  # the sample indices of the prompt this lease covers
    version: int  # the weights the worker held when it took the lease
    deadline: float
    prefixes: Dict[int, Sample]  # sample -> tokens already generated (continued, not regenerated)


@dataclasses.dataclass
class _Batch:
    step: int
    prompts: int
    n: int
    done: Dict[Tuple[int, int], Sample] = dataclasses.field(default_factory=dict)

    def complete(self) -> bool:
        return len(self.done) == self.prompts * self.n


class Ledger:
    def __init__(self, staleness: int, deadline_s: float, keep_prefixes: bool = True):
        self.k, self.deadline_s, self.keep_prefixes = staleness, deadline_s, keep_prefixes
        self.batches: Dict[int, _Batch] = {}
        self.open: Dict[int, Lease] = {}
        self.prefix: Dict[Key, Sample] = {}
        self._ids = itertools.count(1)
        self.stats = {"redispatched": 0, "duplicates": 0, "returned": 0, "unknown_lease": 0}
        self.per_worker: Dict[str, int] = {}
        self._reset_indexes()

    def _reset_indexes(self) -> None:
        self._holders: Dict[Key, List[Lease]] = {}  # sample -> its open leases
        self._by_worker: Dict[str, Set[int]] = {}
        self._candidates: List[Group] = []  # sorted; a superset of the groups with a free sample
        self._in_candidates: Set[Group] = set()
        self._deadlines: List[Tuple[float, int]] = []  # heap of (deadline, lease id), open or not
        for step, batch in self.batches.items():
            for i in range(batch.prompts):
                self._offer((step, i))

    # ------------------------------------------------------------------ indexes
    def _offer(self, group: Group) -> None:
        if group not in self._in_candidates:
            self._in_candidates.add(group)
            bisect.insort(self._candidates, group)

    def _drop(self, index: int) -> None:
        self._in_candidates.discard(self._candidates.pop(index))

    def _expire(self, now: float) -> None:
        """Leases whose deadline has passed no longer hold their samples: their groups may be free."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self.open.get(lease_id)
            if lease is not None:
                self._offer((lease.step, lease.prompt))

    def _close(self, lease_id: int) -> Optional[Lease]:
        """Remove an open lease from the book and its indexes; None if it is not open. Its undone
        samples (if any) are free again."""
        lease = self.open.pop(lease_id, None)
        if lease is None:
            return None
        for j in lease.samples:
            key = (lease.step, lease.prompt, j)
            holders = [other for other in self._holders[key] if other is not lease]
            if holders:
                self._holders[key] = holders
            else:
                del self._holders[key]
        self._by_worker[lease.worker].discard(lease.id)
        self._offer((lease.step, lease.prompt))
        return lease

    def _leases_of(self, worker: str) -> List[int]:
        return sorted(self._by_worker.get(worker, ()))

    def _free(self, group: Group, worker: str, now: float) -> Tuple[List[int], bool, bool]:
        """(the group's samples free for `worker`, whether any of those was held before, whether any
        sample is free for anyone). A sample is free when no lease holds it within its deadline; it
        is not free for a worker that holds it (a straggler is not handed its own samples again)."""
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

    # ------------------------------------------------------------------ what is wanted
    def want(self, step: int, prompts: int, n: int) -> None:
        if step in self.batches:
            raise ValueError(f"batch {step} is already wanted")
        self.batches[step] = _Batch(step, prompts, n)
        for i in range(prompts):
            self._offer((step, i))

    # ------------------------------------------------------------------ handing out work
    def lease(self, worker: str, version: int, now: float, max_groups: int = 1) -> List[Lease]:
        """Up to `max_groups` prompts' missing samples for `worker`, oldest batch first, only from
        batches its weights may start (version >= step - 1 - k)."""
        self._expire(now)
        out, i = [], 0
        while i < len(self._candidates) and len(out) < max_groups:
            group = self._candidates[i]
            samples, again, anyone = self._free(group, worker, now)
            if not samples:
                if anyone:
                    i += 1
                else:  # nothing here for anybody until a lease closes or expires
                    self._drop(i)
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
            if not self._free(group, "", now)[2]:  # leased whole: set aside until something changes
                self._drop(i)
        return out

    def progress(self, lease_id: int, sample: int, prefix: Sample) -> None:
        """The tokens a lease's sample has so far (chunked generation), kept for a successor."""
        lease = self.open.get(lease_id)
        if lease is not None and self.keep_prefixes and sample in lease.samples:
            key = (lease.step, lease.prompt, sample)
            old = self.prefix.get(key)
            if old is None or len(prefix.tokens) > len(old.tokens):
                self.prefix[key] = prefix

    def complete(self, lease_id: int, samples: Dict[int, Sample]) -> List[int]:
        """Record a lease's finished samples; returns those accepted (first completions). The lease
        closes; any of its samples not returned go back to the queue."""
        lease = self._close(lease_id)
        if lease is None:
            self.stats["unknown_lease"] += 1  # from a worker of a run before a restart: dropped
            return []
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
        """Close every open lease of `worker`: their undone samples are free again (with their
        prefixes under keep_prefixes). Returns how many samples went back."""
        returned = 0
        for lease_id in self._leases_of(worker):
            lease = self._close(lease_id)
            batch = self.batches.get(lease.step)
            for j in lease.samples:
                if batch is not None and (lease.prompt, j) not in batch.done:
                    returned += 1
                    if not self.keep_prefixes:
                        self.prefix.pop((lease.step, lease.prompt, j), None)
        self.stats["returned"] += returned
        return returned

    # ------------------------------------------------------------------ what is finished
    def ready(self) -> List[Tuple[int, List[List[Sample]]]]:
        """Finished batches in step order, each as [prompt][sample], removed from the book; a batch
        waits for every earlier one (the trainer takes step s before s + 1)."""
        out = []
        for step in sorted(self.batches):
            b = self.batches[step]
            if not b.complete():
                break
            out.append((step, [[b.done[(i, j)] for j in range(b.n)] for i in range(b.prompts)]))
            del self.batches[step]
        return out

    def oldest_open(self) -> Optional[int]:
        return min(self.batches) if self.batches else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What a checkpoint keeps: the wanted batches, their finished samples and the prefixes.
        Open leases are not kept: the workers of a stopped run leave with it, so on resume their
        samples are free again."""
        return {"batches": {s: dataclasses.asdict(b) for s, b in self.batches.items()},
                "prefix": {k: dataclasses.asdict(v) for k, v in self.prefix.items()},
                "stats": dict(self.stats), "per_worker": dict(self.per_worker)}

    def load_state_dict(self, state: dict) -> None:
        self.batches = {}
        for s, b in state["batches"].items():
            batch = _Batch(b["step"], b["prompts"], b["n"])
            batch.done = {tuple(k): Sample(**v) for k, v in b["done"].items()}
            self.batches[int(s)] = batch
        self.prefix = {tuple(k): Sample(**v) for k, v in state["prefix"].items()}
        self.stats, self.per_worker = dict(state["stats"]), dict(state["per_worker"])
        self.open = {}
        self._reset_indexes()
