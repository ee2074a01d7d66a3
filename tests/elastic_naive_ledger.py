"""The elastic rollout ledger's rules as plain scans: the reference the project's indexed `Ledger`
(verl_hpc/trainer/placement/elastic/ledger.py) is held to. It keeps the Ledger's bookkeeping of
batches, completions, prefixes and counters (no index there) and replaces every use of an index
(who holds a sample, which groups may have a free sample, which leases a worker holds, which
deadlines passed) by a walk over every open batch and lease, so there is no index to get wrong.
Tests drive both books with the same random calls (tests/unit/trainer/test_elastic_ledger.py) and
the simulated cluster with both (tests/unit/test_elastic_sim.py), and check every answer.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

from verl_hpc.trainer.placement.elastic.ledger import Lease, Ledger


class NaiveLedger(Ledger):
    def _reset_indexes(self) -> None:
        pass  # none

    def _offer(self, group) -> None:
        pass  # no candidate list: every call walks every group

    def _close(self, lease_id: int) -> Optional[Lease]:
        return self.open.pop(lease_id, None)

    def _leases_of(self, worker: str) -> List[int]:
        return [i for i, lease in self.open.items() if lease.worker == worker]

    def _holders(self, key) -> List[Lease]:
        return [lease for lease in self.open.values() if (lease.step, lease.prompt) == key[:2] and key[2] in lease.samples]

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

    def lease(self, worker: str, version: int, now: float, max_groups: int = 1) -> List[Lease]:
        out = []
        for step, prompt, samples, again in self._missing(worker, now):
            if len(out) >= max_groups or version < step - 1 - self.k:
                break  # enough, or later batches need newer weights still
            prefixes = {j: self.prefix[(step, prompt, j)] for j in samples if (step, prompt, j) in self.prefix}
            lease = Lease(next(self._ids), worker, step, prompt, tuple(samples), version, now + self.deadline_s,
                          prefixes)
            self.open[lease.id] = lease
            if again:
                self.stats["redispatched"] += len(samples)
            out.append(lease)
        return out
