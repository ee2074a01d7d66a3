"""The elastic rollout ledger's rules as plain scans: the reference the project's indexed `Ledger`
(verl_hpc/trainer/placement/elastic/ledger.py) is held to. Every call walks every open batch and
every open lease of a group, so there is no index to get wrong; tests drive both books with the same
random calls (tests/unit/trainer/test_elastic_ledger.py) and the simulated cluster with both
(tests/unit/test_elastic_sim.py), and check that every answer is the same. No checkpoint methods:
the tests compare answers, not states.
"""
from __future__ import annotations

import itertools
from typing import Dict, Iterator, List, Optional, Tuple

from verl_hpc.trainer.placement.elastic.ledger import Lease, _Batch
from verl_hpc.trainer.placement.inflight import Sample

Key = Tuple[int, int, int]  # (step, prompt, sample)


class NaiveLedger:
    def __init__(self, staleness: int, deadline_s: float, keep_prefixes: bool = True):
        self.k, self.deadline_s, self.keep_prefixes = staleness, deadline_s, keep_prefixes
        self.batches: Dict[int, _Batch] = {}
        self.open: Dict[int, Lease] = {}
        self.prefix: Dict[Key, Sample] = {}
        self._ids = itertools.count(1)
        self.stats = {"redispatched": 0, "duplicates": 0, "returned": 0, "unknown_lease": 0}
        self.per_worker: Dict[str, int] = {}

    # ------------------------------------------------------------------ what is wanted
    def want(self, step: int, prompts: int, n: int) -> None:
        if step in self.batches:
            raise ValueError(f"batch {step} is already wanted")
        self.batches[step] = _Batch(step, prompts, n)

    def _holders(self, key: Key) -> List[Lease]:
        return [lease for lease in self.open.values() if (lease.step, lease.prompt) == key[:2] and key[2] in lease.samples]

    def _close(self, lease_id: int) -> Optional[Lease]:
        """Remove an open lease; None if it is not open."""
        return self.open.pop(lease_id, None)

    def _missing(self, worker: str, now: float) -> Iterator[Tuple[int, int, List[int], bool]]:
        """(step, prompt, samples free for `worker`, whether any was held before) in step order. A
        sample is free when no lease holds it within its deadline and `worker` holds none of it
        (a straggler is not handed its own samples again)."""
        for step in sorted(self.batches):
            b = self.batches[step]
            for i in range(b.prompts):
                free, again = [], False
                for j in range(b.n):
                    if (i, j) in b.done:
                        continue
                    held = self._holders((step, i, j))
                    if not any(lease.deadline > now or lease.worker == worker for lease in held):
                        free.append(j)
                        again |= bool(held)
                if free:
                    yield step, i, free, again

    # ------------------------------------------------------------------ handing out work
    def lease(self, worker: str, version: int, now: float, max_groups: int = 1) -> List[Lease]:
        """Up to `max_groups` prompts' missing samples for `worker`, oldest batch first, only from
        batches its weights may start (version >= step - 1 - k)."""
        out = []
        for step, prompt, samples, again in self._missing(worker, now):
            if len(out) >= max_groups:
                break
            if version < step - 1 - self.k:
                break  # later batches need newer weights still
            prefixes = {j: self.prefix[(step, prompt, j)] for j in samples if (step, prompt, j) in self.prefix}
            lease = Lease(next(self._ids), worker, step, prompt, tuple(samples), version, now + self.deadline_s,
                          prefixes)
            self.open[lease.id] = lease
            if again:
                self.stats["redispatched"] += len(samples)
            out.append(lease)
        return out

    def progress(self, lease_id: int, sample: int, prefix: Sample) -> None:
        """The tokens a lease's sample has so far (chunked generation), kept for a successor."""
        lease = self.open.get(lease_id)
        if lease is not None and self.keep_prefixes and sample in lease.samples:
            key = (lease.step, lease.prompt, sample)
            if len(prefix.tokens) > len(self.prefix.get(key, Sample()).tokens):
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
        for lease_id in [i for i, lease in self.open.items() if lease.worker == worker]:
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
