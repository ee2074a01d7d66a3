"""Who is in an elastic rollout pool: joins, heartbeats, leaves with their reasons, and the rule
that ends a run whose pool stays too small.

    pool = Pool(e.min_rollout_workers, e.heartbeat_timeout_s, e.lost_timeout_s)   # e: placement.elastic
    pool.join("w3", now, job="123456_2", node="n17")
    pool.beat("w3", now)
    pool.leave("w3", now, "preempted (SIGTERM)")   # or reap(now) finds the silent ones
    pool.check(now)   # PoolLostError once fewer than min_workers for longer than lost_timeout_s

A worker that stops beating (SIGKILL, a node lost: nothing tells the trainer) is taken out by
`reap` after heartbeat_timeout_s, with that as its reason; one that says goodbye (scancel's
SIGTERM, its time limit's warning signal, an error it caught) leaves at once with its own reason.
Every event is kept, in order, for the metrics, the plot and the status line.

Pure bookkeeping, clocks passed in (ledger.py says why).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from verl_hpc.errors import VerlHpcError


class PoolLostError(VerlHpcError, RuntimeError):
    """Fewer rollout workers than placement.elastic.min_rollout_workers for longer than its timeout."""

    exit_code, kind = 29, "elastic rollout"


@dataclasses.dataclass
class Member:
    worker: str
    joined: float
    last_beat: float
    info: Dict[str, str]


@dataclasses.dataclass(frozen=True)
class Event:
    time: float
    worker: str
    kind: str  # "join" | "leave"
    reason: str
    size: int  # the pool's size after the event


class Pool:
    def __init__(self, min_workers: int, heartbeat_timeout_s: float, lost_timeout_s: float, now: float = 0.0):
        self.min_workers, self.heartbeat_timeout_s, self.lost_timeout_s = min_workers, heartbeat_timeout_s, lost_timeout_s
        self.members: Dict[str, Member] = {}
        self.events: List[Event] = []
        self._short_since: Optional[float] = now if min_workers > 0 else None

    def __len__(self) -> int:
        return len(self.members)

    def join(self, worker: str, now: float, **info: str) -> None:
        if worker in self.members:
            raise ValueError(f"rollout worker {worker} joined twice")
        self.members[worker] = Member(worker, now, now, dict(info))
        self._event(now, worker, "join", ", ".join(f"{k} {v}" for k, v in info.items()))

    def beat(self, worker: str, now: float) -> bool:
        """A heartbeat; False for a worker that is not (or no longer) in the pool: it must leave."""
        member = self.members.get(worker)
        if member is None:
            return False
        member.last_beat = now
        return True

    def leave(self, worker: str, now: float, reason: str) -> bool:
        if self.members.pop(worker, None) is None:
            return False
        self._event(now, worker, "leave", reason)
        return True

    def reap(self, now: float) -> List[str]:
        """Take out the workers silent for longer than heartbeat_timeout_s; returns them."""
        silent = [m for m in self.members.values() if now - m.last_beat > self.heartbeat_timeout_s]
        for m in silent:
            self.leave(m.worker, now, f"no heartbeat for {now - m.last_beat:.0f} s (killed, or its node lost)")
        return [m.worker for m in silent]

    def _event(self, now: float, worker: str, kind: str, reason: str) -> None:
        self.events.append(Event(now, worker, kind, reason, len(self.members)))
        if len(self.members) < self.min_workers:
            self._short_since = now if self._short_since is None else self._short_since
        else:
            self._short_since = None

    def check(self, now: float) -> None:
        """Raise PoolLostError once the pool has been below min_workers for over lost_timeout_s."""
        if self._short_since is None or now - self._short_since <= self.lost_timeout_s:
            return
        lost = [e for e in self.events if e.kind == "leave" and e.time >= self._short_since - self.lost_timeout_s]
        named = "; ".join(f"{e.worker} at {e.time:.0f} s: {e.reason}" for e in lost) or "none had joined"
        raise PoolLostError(f"the rollout pool has had {len(self)} worker(s), fewer than "
                            f"placement.elastic.min_rollout_workers = {self.min_workers}, for "
                            f"{now - self._short_since:.0f} s (placement.elastic.lost_timeout_s = "
                            f"{self.lost_timeout_s:g}); workers lost: {named}")

    def waiting(self) -> bool:
        """Below the minimum: training waits (until check gives up)."""
        return len(self.members) < self.min_workers

    def sizes(self) -> List[Tuple[float, int]]:
        """(time, pool size) after every event: the pool over time, for the plot."""
        return [(e.time, e.size) for e in self.events]
