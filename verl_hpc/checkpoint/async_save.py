"""AsyncSaver: the caller waits for a CPU copy of its tensors; files are written in the background.

Design choice: the background thread runs the whole save, *including* its three collectives and
the commit, on a gloo group that the saver creates for itself at construction. Collectives on the
training's own group from a second thread would interleave with the training's collectives in a
different order on different ranks (a hang or a silent mix-up); a private group has no other
users, so that cannot happen, and the checkpoint is published as soon as the slowest rank has
written, without waiting for the trainer to call anything. The cost: constructing an AsyncSaver
is itself a collective (torch's new_group must be called by every rank of the default group).

    saver = AsyncSaver(root, keep_last=cfg.checkpoint.keep_last,  # every rank, same point of the program
                       timeout_s=collective_timeout_s)
    saver.save(step, tensors, metadata=..., rank_state=...)   # returns after the snapshot
    ...train...
    saver.save(step2, ...)                         # first waits for the previous save
    saver.wait()                                   # before exit: raises if a save failed

Errors of a background save are logged when they happen and raised by the next save()/wait().
The snapshot buffers are kept and reused by the next save (no page faults on the hot path), so
the saver holds one CPU copy of this rank's checkpointed tensors for its lifetime.
"""
from __future__ import annotations

import copy
import datetime
import logging
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from verl_hpc.checkpoint.comm import SingleComm, TorchComm
from verl_hpc.checkpoint.errors import CheckpointError
from verl_hpc.checkpoint.save import save_checkpoint
from verl_hpc.checkpoint.sharded import ShardedTensor

log = logging.getLogger("verl_hpc.checkpoint")


def _private_comm(group, timeout_s: float):
    if group is not None and hasattr(group, "gather") and hasattr(group, "bcast"):
        return group  # a comm.Comm (tests: ThreadComm)

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return SingleComm()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    # a new group does not inherit the default group's timeout (torch gives gloo 30 minutes): a rank
    # that died mid-save would hold the others that long past the job's collective timeout
    return TorchComm(dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))


class AsyncSaver:
    """`timeout_s`: the job's collective timeout (trainer.collective_timeout_s), for the saver's own
    gloo group."""

    def __init__(self, root, *, timeout_s: float, keep_last: int = 0, group=None, layout: Optional[dict] = None,
                 replicas: str = "lowest", **save_kw) -> None:
        self.root = Path(root)
        self._kw = dict(keep_last=keep_last, layout=layout, replicas=replicas, **save_kw)
        self._comm = _private_comm(group, timeout_s)
        self._buffers: dict = {}
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None
        self._result: Optional[Path] = None
        self._error: Optional[BaseException] = None
        self.last_blocked_s = 0.0  # how long the last save() held its caller

    def _snapshot(self, i: int, t: ShardedTensor) -> torch.Tensor:
        key = (i, t.name, t.offsets, t.shape, t.local.dtype)
        buf = self._buffers.get(key)
        if buf is None:  # pinned when the source is on an accelerator: a faster device-to-host copy
            buf = torch.empty(t.shape, dtype=t.local.dtype, pin_memory=t.local.device.type != "cpu")
            self._buffers[key] = buf
        buf.copy_(t.local.detach())
        return buf

    def save(self, step: int, tensors: list, *, metadata: Optional[dict] = None,
             rank_state: Optional[dict] = None) -> None:
        """Snapshot `tensors` (and copies of metadata/rank_state), start writing, return."""
        t0 = time.perf_counter()
        self.wait()
        keep = {(i, t.name, t.offsets, t.shape, t.local.dtype) for i, t in enumerate(tensors)}
        self._buffers = {k: v for k, v in self._buffers.items() if k in keep}
        snap = [ShardedTensor(t.name, self._snapshot(i, t), t.global_shape, t.offsets)
                for i, t in enumerate(tensors)]
        state = {k: bytes(v) if isinstance(v, (bytes, bytearray)) else np.array(v, copy=True)
                 for k, v in (rank_state or {}).items()}
        meta = copy.deepcopy(metadata or {})  # the trainer keeps appending to its metric history
        self._step, self._result, self._error = int(step), None, None
        self._thread = threading.Thread(target=self._run, args=(int(step), snap, meta, state),
                                        name=f"ckpt-async-save-{step}")  # not a daemon: exit waits for it
        self._thread.start()
        self.last_blocked_s = time.perf_counter() - t0

    def _run(self, step, snap, meta, state) -> None:
        try:
            self._result = save_checkpoint(self.root, step, snap, metadata=meta, rank_state=state,
                                           group=self._comm, **self._kw)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            log.error("async checkpoint save of step %d failed: %s", step, e)
            self._error = e

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Optional[Path]:
        """Block until the save in flight is committed; return its path (None if there was none)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"async checkpoint save of step {self._step} failed: {err}") from err
        return self._result

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
