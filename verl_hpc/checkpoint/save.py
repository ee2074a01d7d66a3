"""save_checkpoint: every rank writes its own file, rank 0 plans, indexes and publishes.

Three object collectives, each reached by every rank even when its own part failed (the failure
travels in the message, and then every rank raises the same CheckpointError):
  1. gather   each rank's slab descriptions (or its local error)    -> rank 0 plans, makes tmp dir
  2. scatter  each rank's share of the writes (or the plan's error)  -> ranks write + fsync files
  3. gather   each rank's status (file size or error) -> rank 0 writes index, commits, retention
     bcast    rank 0's verdict (the published path or the error)
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import numpy as np

from verl_hpc.checkpoint import dtypes, index, publish
from verl_hpc.checkpoint.comm import as_comm
from verl_hpc.checkpoint.errors import CheckpointError
from verl_hpc.checkpoint.plan import Desc, check_name, make_plan, rank_file
from verl_hpc.checkpoint.progress import INTERVAL_S, Progress
from verl_hpc.checkpoint.rankfile import FORMAT, VERSION, PieceToWrite, write_rank_file
from verl_hpc.checkpoint.sharded import ShardedTensor
from verl_hpc.runtime import faults

log = logging.getLogger("verl_hpc.checkpoint")


def _describe(tensors: list, rank_state: dict, metadata, is_root: bool) -> list[Desc]:
    """This rank's slabs; also the local checks whose failure must reach the other ranks."""
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are written little-endian; this host is big-endian")
    descs = []
    for t in tensors:
        if not isinstance(t, ShardedTensor):
            raise CheckpointError(f"save_checkpoint takes ShardedTensor objects, got {type(t).__name__}")
        check_name(t.name)
        descs.append(Desc(t.name, t.global_shape, dtypes.dtype_name(t.local.dtype), t.offsets, t.shape,
                          t.local.numel() * t.local.element_size()))
    for key, value in rank_state.items():
        check_name(key, "rank_state key")
        if not isinstance(value, (bytes, bytearray)) and np.asarray(value).dtype.kind not in "biuf":
            raise CheckpointError(f"rank_state[{key!r}]: numeric numpy arrays or bytes only (no pickles), "
                                  f"got {type(value).__name__}")
    if is_root:
        json.dumps(metadata)  # TypeError names the first value that is not JSON-able
    return descs


def _error(e: BaseException) -> str:
    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, (TypeError, ValueError, OSError)):
        return f"{type(e).__name__}: {e}"
    return "".join(traceback.format_exception(e)).strip()  # unexpected: keep where it came from


def _raise_if_failed(errors: list) -> None:
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        shown = "; ".join(f"rank {r}: {e}" for r, e in bad[:5])
        raise CheckpointError(f"checkpoint save failed on {len(bad)} rank(s): {shown}")


def save_checkpoint(root, step: int, tensors: list, *, metadata: Optional[dict] = None,
                    rank_state: Optional[dict] = None, layout: Optional[dict] = None,
                    keep_last: int = 0, group=None, replicas: str = "lowest",
                    progress_interval: float = INTERVAL_S) -> Path:
    """Write `tensors` (this rank's ShardedTensors) as checkpoint `root/step_<step>`; collective.

    metadata: JSON-able dict, taken from rank 0 (resolved config YAML text, trainer state, ...).
    rank_state: this rank's own numeric arrays / bytes (RNG states), read back per rank.
    layout: the writer's layout (tp/pp/dp/...), recorded for information only.
    keep_last: after committing, keep only the k most recent checkpoints (0 = keep all).
    group: None (default group, or a single process), a torch ProcessGroup, or a comm.Comm.
    Returns the published directory on every rank.
    """
    comm = as_comm(group)
    root, step = Path(root), int(step)
    metadata, rank_state = metadata or {}, rank_state or {}
    t0 = time.time()
    try:
        mine, err = _describe(tensors, rank_state, metadata, comm.rank == 0), None
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        mine, err = None, _error(e)

    # 1 + 2: plan on rank 0
    gathered = comm.gather((mine, err))
    shares = None
    if comm.rank == 0:
        token = publish.new_token()
        tmp_dir = root / f"{publish.step_dir_name(step)}{index.TMP_MARK}{token}"
        try:
            _raise_if_failed([e for _, e in gathered])
            plan = make_plan([d for d, _ in gathered], replicas)
            root.mkdir(parents=True, exist_ok=True)
            publish.clean_stale(root, before=t0)
            tmp_dir.mkdir()
            shares = [(str(tmp_dir), token, w, None) for w in plan.writes]
        except Exception as e:  # noqa: BLE001
            shares = [(None, None, None, _error(e))] * comm.size
    tmp, token, writes, err = comm.scatter(shares)
    if err:
        raise CheckpointError(err)

    # each rank: its file
    total = sum(tensors[i].local.numel() * tensors[i].local.element_size() for i, _ in writes)
    progress = Progress(f"checkpoint save step {step}", total, enabled=comm.rank == 0, interval=progress_interval)
    try:
        os.makedirs(tmp, exist_ok=True)  # rank 0 made it; this only guards against a slow metadata cache
        pieces = []
        for i, dataset in writes:
            t = tensors[i]
            pieces.append(PieceToWrite(dataset, t.name, t.local.detach().to("cpu").contiguous(),
                                       t.global_shape, t.offsets))
        attrs = dict(format=FORMAT, version=VERSION, rank=comm.rank, world_size=comm.size, step=step)
        size = write_rank_file(Path(tmp) / rank_file(comm.rank), pieces, rank_state, attrs, progress)
        faults.maybe("save")  # the resilience tests' hook: a rank lost between its file and the commit
        status = (size, total, None)
    except Exception as e:  # noqa: BLE001
        status = (None, None, _error(e))

    # 3: index, commit, retention on rank 0
    statuses = comm.gather(status)
    verdict = None
    if comm.rank == 0:
        try:
            _raise_if_failed([s[2] for s in statuses])
            files = [dict(name=rank_file(r), rank=r, bytes=s[0]) for r, s in enumerate(statuses)]
            text = index.build_index(step=step, world_size=comm.size, layout=layout, files=files,
                                     tensors=plan.tensors, metadata=metadata)
            with open(Path(tmp) / index.INDEX, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            final = root / publish.step_dir_name(step)
            publish.commit(Path(tmp), final, token)
            publish.apply_retention(root, keep_last, token)
            nbytes, dt = sum(s[1] for s in statuses), time.time() - t0
            log.info("checkpoint step %d saved to %s: %.1f MB from %d rank(s) in %.2f s (%.0f MB/s)",
                     step, final, nbytes / 1e6, comm.size, dt, nbytes / 1e6 / max(dt, 1e-9))
            verdict = (str(final), None)
        except Exception as e:  # noqa: BLE001
            verdict = (None, _error(e))
    final, err = comm.bcast(verdict)
    if err:
        raise CheckpointError(err)
    return Path(final)
