"""`sync(actor, rollout, bucket_mb=...)`: the actor's new weights into the rollout engine, after
each update (the trainer runs it lazily, right before the next generation), collectively and
without disk.

    metrics = sync(actor, rollout, bucket_mb=cfg.resharding.bucket_mb)
    # {"sync/seconds", "sync/bytes", "sync/gb_per_s", "sync/buckets", "sync/peak_bucket_bytes", ...}

Every rank of the job calls it at the same point of the step (SPMD), because the export is a
collective: Megatron's model-parallel ranks all-gather each parameter over TP and broadcast it
over PP, so that every rank ends up with every full HF tensor (verl_hpc.models.weights). Each
rank's rollout engine takes the full tensors and cuts its own slices, whatever its inference TP
(vLLM's loaders do this), so no inference-side collective is needed. The stream goes through
`BucketStream` (buckets of `bucket_mb`) into ONE `rollout.load_weights` call.

Steps: export -> buckets -> load_weights, inside the actor's `resident("forward")` block
(held_resident), then the agreement: with param_offload the engine offloads only after the rollout has loaded
the last bucket, whose tensors may be views of live parameters. The rollout must have its weights
mapped to take new ones: waking it is the trainer's business (trainer/rollout_weights.py wakes
vLLM's weights only, calls this, then wakes the KV cache once the actor has offloaded).

Failure handling: if this rank's consumer raises (a bad name, a shape the engine rejects), the
rest of the export is still run (discarded) so that the other ranks' collectives complete, and
then one all-reduce tells every rank whether any rank failed: all ranks raise together instead
of some hanging in a collective. A failure inside the export itself (a collective error or
timeout) is not drained: the collective is already broken, the runtime's timeout ends the job.

Memory: the extra memory of a sync on a rank is the bucket (<= bucket bytes, or the one tensor
larger than a bucket), the tensor the export is producing (its TP parts and their concatenation)
and what the consumer holds while it loads. `sync/peak_bucket_bytes` is the first, counted in
the code path; verl_hpc.resharding.memory measures the whole process-level peak.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from verl_hpc.errors import VerlHpcError
from verl_hpc.resharding.buckets import BucketStream, bucket_bytes_from
from verl_hpc.runtime.device import collective_device

log = logging.getLogger(__name__)


class SyncError(VerlHpcError, RuntimeError):
    """The weight sync failed on at least one rank; the rollout's weights are undefined."""

    exit_code, kind = 15, "weight sync"


def export_source(actor) -> Callable[[], Iterator[Tuple[str, torch.Tensor]]]:
    """What to call for the weight stream: `export_hf_weights` of the TrainingEngine behind an
    actor role (verl_hpc.engines.megatron.roles.Actor has `.engine`) or of the engine itself; for
    a bare Megatron model from verl_hpc.models.build_gpt_model (or its list of virtual-pipeline
    chunks, DDP-wrapped or not), verl_hpc.models.export_hf_weights on it."""
    engine = getattr(actor, "engine", actor)
    if hasattr(engine, "export_hf_weights"):
        return engine.export_hf_weights
    chunks = engine if isinstance(engine, (list, tuple)) else [engine]
    if chunks and all(hasattr(c, "verl_arch") or hasattr(c, "module") for c in chunks):
        from verl_hpc.models import export_hf_weights

        return lambda: export_hf_weights(engine)
    raise TypeError(f"{type(actor).__name__} has no export_hf_weights(): pass the actor role, its "
                    "TrainingEngine, or a model built by verl_hpc.models.build_gpt_model")


def held_resident(actor) -> ContextManager:
    """The actor's engine kept resident (its `resident("forward")`: parameters on the device) for
    the whole sync. The export's own resident block ends when its generator is exhausted, but the
    rollout takes the last bucket only after that, and the bucket's tensors may be views of live
    parameters (norm weights always, every weight at TP 1): an offload in between (param_offload:
    `storage.resize_(0)`) would leave the rollout copying from freed storage. An engine without
    offload (or an object without `resident`) needs nothing held."""
    engine = getattr(actor, "engine", actor)
    resident = getattr(engine, "resident", None)
    return resident("forward") if callable(resident) else contextlib.nullcontext()


def _agree(failed: bool, seconds: float):
    """(any rank failed, the slowest rank's seconds, lowest failing rank) over the default group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failed, seconds, 0 if failed else -1  # alone: nobody to agree with, no round trip
    big = float(dist.get_world_size() + 1)
    me = float(dist.get_rank()) if failed else big
    vec = torch.tensor([float(failed), seconds, -me], dtype=torch.float64,
                       device=collective_device())
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    first = int(-vec[2].item())
    return bool(vec[0].item() > 0), float(vec[1].item()), (first if first < big else -1)


class WeightSync:
    """The resharding step with its settings; call it after every actor update.

        syncer = WeightSync.from_config(cfg.resharding)
        metrics = syncer(actor, rollout)
    """

    def __init__(self, *, bucket_mb: Optional[float] = None, bucket_bytes: Optional[int] = None):
        self.bucket_bytes = bucket_bytes_from(bucket_mb, bucket_bytes)
        self.last: Dict[str, float] = {}
        self.count = 0

    @classmethod
    def from_config(cls, section) -> "WeightSync":
        """From the job's `resharding:` section."""
        return cls(bucket_mb=section.bucket_mb)

    def __call__(self, actor, rollout) -> Dict[str, float]:
        export = export_source(actor)
        start = time.perf_counter()
        error: Optional[BaseException] = None
        # resident until load_weights has returned: only then may the actor offload (held_resident)
        with held_resident(actor):
            stream = BucketStream(export(), self.bucket_bytes)
            try:
                rollout.load_weights(iter(stream))
                if not stream.source_exhausted:
                    raise SyncError(f"{type(rollout).__name__}.load_weights returned before taking "
                                    f"every tensor ({stream.tensors} taken)")
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the other ranks know)
                error = exc
                if not stream.source_failed:
                    dropped = stream.drain()  # keep the peers' collectives going to the end
                    log.error("weight sync: the rollout failed after %d tensors (%s); ran the export "
                              "to its end (%d more tensors discarded) so the other ranks do not hang",
                              stream.tensors, exc, dropped)
            finally:
                stream.close()  # the export's own resident block ends here at the latest
        seconds = time.perf_counter() - start
        if error is not None and stream.source_failed:
            raise error  # the collective itself broke: no agreement round is possible
        failed, slowest, first = _agree(error is not None, seconds)
        if failed:
            where = f"rank {first}" if first >= 0 else "some rank"
            if error is not None:
                raise SyncError(f"weight sync failed on {where} (this rank: "
                                f"{type(error).__name__}: {error})") from error
            raise SyncError(f"weight sync failed on {where}; this rank loaded its weights, but the "
                            "job's rollout engines no longer agree (see that rank's log)")
        self.count += 1
        self.last = {
            "sync/seconds": slowest,
            "sync/bytes": float(stream.bytes),
            "sync/gb_per_s": stream.bytes / max(slowest, 1e-9) / 1e9,
            "sync/buckets": float(stream.buckets),
            "sync/peak_bucket_bytes": float(stream.peak_bucket_bytes),
            "sync/tensors": float(stream.tensors),
            "sync/largest_tensor_bytes": float(stream.largest_tensor_bytes),
            "sync/bucket_bytes": float(self.bucket_bytes),
            # this rank's split of its own wall time: in the export (collectives, re-fusion),
            # in the rollout engine (load_weights minus the export it pulled)
            "sync/export_seconds": stream.export_seconds,
            "sync/load_seconds": max(seconds - stream.export_seconds, 0.0),
        }
        # the first in full; later ones are in the step's metrics (sync/*), not one more log line
        log.log(logging.INFO if self.count == 1 else logging.DEBUG,
                "weight sync %d: %.1f MB in %d buckets (%d tensors) in %.3f s (%.2f GB/s; export "
                "%.3f s, load %.3f s)", self.count, stream.bytes / 1e6, stream.buckets,
                stream.tensors, slowest, self.last["sync/gb_per_s"], stream.export_seconds,
                self.last["sync/load_seconds"])
        return dict(self.last)


def sync(actor, rollout, *, bucket_mb: Optional[float] = None,
         bucket_bytes: Optional[int] = None) -> Dict[str, float]:
    """One weight sync (see the module docstring); a collective over all ranks of the job."""
    return WeightSync(bucket_mb=bucket_mb, bucket_bytes=bucket_bytes)(actor, rollout)
