"""The few collectives a save needs, over small Python objects: gather to rank 0, scatter, broadcast.

A save makes exactly three of them (plan, status, verdict; see `save.py`), never any on tensor
data, and every rank reaches every one of them even when its own part failed: an error travels
inside the message and all ranks raise it together, so one rank's full disk cannot hang the rest.

`as_comm(group)` accepts None (the default torch.distributed group when it is initialised, else a
single process), a torch ProcessGroup, or a Comm object. `ThreadWorld(n)` simulates n ranks as
threads of one process (tests, tools).
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Protocol

import torch.distributed as dist


class Comm(Protocol):
    rank: int
    size: int

    def gather(self, obj: Any) -> Optional[list]: ...   # list on rank 0, None elsewhere
    def scatter(self, objs: Optional[list]) -> Any: ...  # rank 0 hands objs[r] to rank r
    def bcast(self, obj: Any) -> Any: ...                # rank 0's obj everywhere


class SingleComm:
    rank, size = 0, 1

    def gather(self, obj):
        return [obj]

    def scatter(self, objs):
        return objs[0]

    def bcast(self, obj):
        return obj


class TorchComm:
    """Object collectives on a torch.distributed group (gloo, or NCCL staged through the current
    device by torch itself). They pickle in memory between the job's own ranks; nothing here is
    read back from disk."""

    def __init__(self, group=None) -> None:
        self._dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def gather(self, obj):
        out = [None] * self.size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=self._root, group=self.group)
        return out

    def scatter(self, objs):
        box = [None]
        self._dist.scatter_object_list(box, objs if self.rank == 0 else None, src=self._root, group=self.group)
        return box[0]

    def bcast(self, obj):
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]


class ThreadWorld:
    """n simulated ranks in one process: `world.comm(r)` for the thread playing rank r."""

    def __init__(self, size: int, timeout: float = 120.0) -> None:
        self.size = size
        self._slots: list = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size

    def _exchange(self, put, take):
        put(self.world._slots)
        self.world._barrier.wait()
        out = take(self.world._slots)
        self.world._barrier.wait()  # nobody writes the slots again before everyone has read
        return out

    def gather(self, obj):
        def put(slots):
            slots[self.rank] = obj
        return self._exchange(put, lambda slots: list(slots) if self.rank == 0 else None)

    def scatter(self, objs):
        def put(slots):
            if self.rank == 0:
                slots[:] = objs
        return self._exchange(put, lambda slots: slots[self.rank])

    def bcast(self, obj):
        def put(slots):
            if self.rank == 0:
                slots[0] = obj
        return self._exchange(put, lambda slots: slots[0])


def as_comm(group=None) -> Comm:
    if group is not None and hasattr(group, "gather") and hasattr(group, "bcast"):
        return group

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return SingleComm()
    return TorchComm(group)


def is_rank0() -> bool:
    """Rank 0 of the default group, or a process outside any group: the one that logs."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
