"""`sync(actor, rollout, bucket_mb=...)`: the actor's new weights into the rollout engine, after
each update (the trainer runs it lazily, right before the next generation), collectively and
without disk.

    metrics = sync(actor, rollout, bucket_mb=cfg.resharding.bucket_mb)
    # {"sync/seconds", "sync/bytes", "sync/gb_per_s", "sync/buckets", "sync/peak_bucket_bytes", ...}

Every rank of the job calls it at the same point of the step (SPMD), because the transfer is
collective. Two paths (`mode`, resharding.mode; docs/resharding.md):
- sliced (verl_hpc.resharding.sliced): each rank receives only the slices its rollout engine keeps
  (`rollout.weight_slices()`), from the training ranks that hold them, one all_to_all per bucket;
  `delta` sends only what changed. "auto" takes it where the actor has local Megatron shards and
  the plan matches both layouts.
- full: Megatron's model-parallel ranks all-gather each parameter over TP and broadcast it over
  PP, so that every rank ends up with every full HF tensor (verl_hpc.models.weights). Each rank's
  rollout engine takes the full tensors and cuts its own slices, whatever its inference TP (vLLM's
  loaders do this). The stream goes through `BucketStream` (buckets of `bucket_mb`).
Both paths send the rollout's dtype (`rollout.weight_dtype`: model.dtype on GPUs, bf16 or fp16),
cast once on the sending side where the engine holds another (buckets.in_dtype).
Either way the rollout gets ONE `load_weights` call (or `load_weight_slices`, for a sink that
takes slices) carrying every weight; a rollout with a frozen drafter (an MTP drafter, a draft model
folder) then gets one `load_draft_weights` call with its frozen tensors (resharding/mtp.py).

Steps: export -> buckets -> load_weights, inside the actor's `resident("forward")` block
(held_resident), then the agreement: with param_offload the engine offloads only after the rollout has loaded
the last bucket, whose tensors may be views of live parameters. The rollout must have its weights
mapped to take new ones: waking it is the trainer's business (trainer/stages/rollout_weights.py wakes
vLLM's weights only, calls this, then wakes the KV cache once the actor has offloaded).

Failure handling: if this rank's consumer raises (a bad name, a shape the engine rejects), the
rest of the export is still run (discarded) so that the other ranks' collectives complete, and
then one all-reduce tells every rank whether any rank failed: all ranks raise together instead
of some hanging in a collective. A failure inside the export itself (a collective error or
timeout) is not drained: the collective is already broken, the runtime's timeout ends the job.

Memory: the extra memory of a full sync on a rank is the bucket (<= bucket bytes, or the one
tensor larger than a bucket), the tensor the export is producing (its TP parts and their
concatenation) and what the consumer holds while it loads. A sliced sync holds one bucket's send
and receive buffers while the previous bucket loads, and for vLLM one full-shape tensor at a
time. `sync/peak_bucket_bytes` is the buffers, counted in the code path;
verl_hpc.resharding.memory measures the whole process-level peak. Delta keeps copies (sliced.py).

A plan that does not match the layouts (PlanError) stops a `mode="sliced"` sync; under "auto"
this WeightSync switches to the full path for the rest of the run, said once in the log.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.rollout import SERVED_EVERY, SYNC_MODES
from verl_hpc.errors import VerlHpcError
from verl_hpc.resharding.buckets import BucketStream, SourceStream, bucket_bytes_from, in_dtype
from verl_hpc.resharding.mtp import MtpWeights, draft_source
from verl_hpc.resharding import served_check
from verl_hpc.resharding.plan import PlanError
from verl_hpc.resharding.served_check import ServedCheck
from verl_hpc.resharding.sliced import SlicedSync, holdings
from verl_hpc.runtime.device import collective_device

log = logging.getLogger(__name__)


class SyncError(VerlHpcError, RuntimeError):
    """The weight sync failed on at least one rank; the rollout's weights are undefined."""

    exit_code, kind = 15, "weight sync"


def export_source(actor) -> Callable[[], Iterator[Tuple[str, torch.Tensor]]]:
    """What to call for the weight stream: `export_hf_weights` of the TrainingEngine behind an
    actor role (verl_hpc.engines.roles.Actor has `.engine`) or of the engine itself; for
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


MODES = SYNC_MODES


def sliced_source(actor):
    """A context manager giving the actor's local shards (resident, parameters gathered): Megatron
    model chunks, or a holdings view (the FSDP engine's), for the sliced sync; None when the actor
    has no local shards to read (then only the full path applies)."""
    engine = getattr(actor, "engine", actor)
    exported = getattr(engine, "exported_model", None)
    if callable(exported):
        return exported
    chunks = engine if isinstance(engine, (list, tuple)) else [engine]
    if chunks and all(hasattr(c, "verl_arch") or hasattr(getattr(c, "module", None), "verl_arch")
                      or hasattr(c, "module") for c in chunks):
        return lambda: contextlib.nullcontext(engine)
    return None


def carriers(items, shapes) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, full-shape tensor) with only the rollout rank's own slice written, for a loader that
    cuts its slice from a full tensor (vLLM's: it narrows to exactly that range; the rest of the
    tensor is never read). The unwritten rest is `torch.empty`: on CPU large allocations are
    mapped lazily, so only the pages of the slice are touched."""
    for name, part, need in items:
        shape = shapes[name]
        if tuple(part.shape) == tuple(shape):
            yield name, part
            continue
        full = torch.empty(shape, dtype=part.dtype, device=part.device)
        full.narrow(need.dim, need.start, need.stop - need.start).copy_(part)
        yield name, full
        full = None


def _feed(stream, load, what: str) -> Optional[BaseException]:
    """Run `load()` (the rollout taking `stream`); on this rank's failure run the collective
    stream to its end (discarded) so the other ranks' collectives complete, and return the error
    for the caller to raise after the agreement round. The stream is closed either way."""
    try:
        load()
        if not stream.source_exhausted:
            raise SyncError(f"{what} returned before taking every tensor ({stream.tensors} taken)")
    except Exception as exc:  # noqa: BLE001 (re-raised by the caller, after the other ranks know)
        if not stream.source_failed:
            dropped = stream.drain()  # keep the peers' collectives going to the end
            log.error("weight sync: the rollout failed after %d tensors (%s); ran the transfer to "
                      "its end (%d more tensors discarded) so the other ranks do not hang",
                      stream.tensors, exc, dropped)
        return exc
    finally:
        stream.close()  # the export's own resident block ends here at the latest
    return None


class WeightSync:
    """The resharding step with its settings; call it after every actor update.

        syncer = WeightSync.from_config(cfg.resharding)
        metrics = syncer(actor, rollout)

    mode: "full" (every rank takes every full HF tensor: TP all-gather, PP broadcast), "sliced"
    (each rank receives only the slices its rollout engine keeps, verl_hpc.resharding.sliced),
    "auto" (sliced where the actor has local Megatron shards and the plan matches both layouts,
    else full, said once in the log). delta: sliced only, send just the changed elements.
    """

    def __init__(self, *, bucket_mb: Optional[float] = None, bucket_bytes: Optional[int] = None,
                 mode: str = "auto", delta: bool = False, check_served_every: Optional[int] = None):
        if mode not in MODES:
            raise ConfigError(f"resharding.mode must be one of {', '.join(MODES)}; got {mode!r}")
        if delta and mode == "full":
            raise ConfigError("resharding.delta needs resharding.mode sliced or auto (the full path "
                              "sends whole tensors)")
        self.bucket_bytes = bucket_bytes_from(bucket_mb, bucket_bytes)
        self.mode, self.delta = mode, delta
        self.sliced = SlicedSync(self.bucket_bytes, delta=delta)
        self.last: Dict[str, float] = {}
        self.count = 0
        self._fallback: Optional[str] = None  # why auto chose the full path
        self.mtp: Optional[MtpWeights] = None  # a frozen drafter's slices, read once (resharding/mtp.py)
        # what the rollout serves, read back at the first sync and every N-th (resharding/served_check.py)
        self.served = ServedCheck(check_served_every) if check_served_every is not None else None

    @classmethod
    def from_config(cls, section) -> "WeightSync":
        """From the job's `resharding:` section."""
        every = SERVED_EVERY if section.check_served_every is None else section.check_served_every  # unresolved: auto's
        return cls(bucket_mb=section.bucket_mb, mode=section.mode, delta=section.delta,
                   check_served_every=every if section.check_served else None)

    def _choose(self, actor, rollout):
        """(the sliced source, or None for the full path)."""
        if self.mode == "full":
            return None
        source = sliced_source(actor)
        why = None
        if source is None:
            why = f"{type(getattr(actor, 'engine', actor)).__name__} has no local shards to slice"
        elif not (hasattr(rollout, "load_weight_slices") or callable(getattr(rollout, "weight_slices", None))):
            why = f"{type(rollout).__name__} does not say which slices it keeps (weight_slices)"
        elif getattr(rollout, "sliced_problem", None):  # an engine that cuts otherwise (vLLM's Transformers backend)
            why = rollout.sliced_problem
        if why is None:
            return source
        if self.mode == "sliced":
            raise SyncError(f"resharding.mode=sliced: {why}; use resharding.mode=auto or full")
        if self._fallback != why:
            log.info("weight sync: the full-tensor path (%s)", why)
            self._fallback = why
        return None

    def __call__(self, actor, rollout) -> Dict[str, float]:
        source = self._choose(actor, rollout)
        start = time.perf_counter()
        check = self.served if (self.served is not None and self.served.due(self.count)
                                and served_check.checkable(rollout)) else None
        if check is not None:
            check.prepare(rollout)  # under rollout.quantization: where the engine quantizes (asked once)
        if source is not None:
            try:
                error, stream, metrics = self._run_sliced(source, rollout, check)
            except PlanError as exc:
                if self.mode == "sliced":
                    raise PlanError(f"resharding.mode=sliced: {exc}; resharding.mode=auto falls back "
                                    "to the full-tensor path") from exc
                log.warning("weight sync: no sliced plan for these layouts (%s); using the "
                            "full-tensor path", exc)
                self.mode = "full"
                return self(actor, rollout)
        else:
            error, stream, metrics = self._run_full(actor, rollout, check)
        if error is None and not stream.source_failed:  # a frozen drafter's own weights, after the policy's
            error = self._load_draft(rollout, metrics, check)
        seconds = time.perf_counter() - start
        if error is None and check is not None and check.expected:
            error = self._verify(check, rollout, metrics)
        if error is not None and stream.source_failed:
            self.sliced.reset()
            raise error  # the collective itself broke: no agreement round is possible
        failed, slowest, first = _agree(error is not None, seconds)
        if failed:
            self.sliced.reset()  # the delta copies may disagree now: the next sync is dense
            where = f"rank {first}" if first >= 0 else "some rank"
            if error is not None:
                raise SyncError(f"weight sync failed on {where} (this rank: "
                                f"{type(error).__name__}: {error})") from error
            raise SyncError(f"weight sync failed on {where}; this rank loaded its weights, but the "
                            "job's rollout engines no longer agree (see that rank's log)")
        self.count += 1
        nbytes = metrics["sync/bytes"]
        self.last = {
            "sync/seconds": slowest,
            "sync/gb_per_s": nbytes / max(slowest, 1e-9) / 1e9,
            "sync/tensors": float(stream.tensors),
            "sync/bucket_bytes": float(self.bucket_bytes),
            # this rank's split of its own wall time: in the export (collectives, re-fusion),
            # in the rollout engine (load_weights minus the export it pulled)
            "sync/export_seconds": stream.export_seconds,
            "sync/load_seconds": max(seconds - stream.export_seconds, 0.0),
            **metrics,
        }
        # the first in full; later ones are in the step's metrics (sync/*), not one more log line
        log.log(logging.INFO if self.count == 1 else logging.DEBUG,
                "weight sync %d (%s): %.1f MB in %d buckets (%d tensors) in %.3f s (%.2f GB/s; "
                "export %.3f s, load %.3f s)", self.count,
                "sliced" + (", delta" if self.delta else "") if metrics["sync/sliced"] else "full",
                nbytes / 1e6, metrics["sync/buckets"], stream.tensors, slowest,
                self.last["sync/gb_per_s"], stream.export_seconds, self.last["sync/load_seconds"])
        return dict(self.last)

    def _load_draft(self, rollout, metrics: Dict[str, float],
                    check: Optional[ServedCheck] = None) -> Optional[BaseException]:
        """vLLM's frozen drafter (an MTP drafter, or a draft_model_path folder): its frozen tensors, this
        rank's slices (resharding/mtp.py); an MTP drafter's embedding and head came with the policy's.
        Local to this rank: a failure is agreed with the others like the policy's load. With `check`
        the drafter's served tensors are read back against them."""
        try:
            self.mtp = draft_source(rollout, self.mtp)
            if self.mtp is None:
                return None
            draft_check = ServedCheck(0) if check is not None else None
            slices = draft_check.expect(self.mtp.slices()) if draft_check is not None else self.mtp.slices()
            info = rollout.load_draft_weights(carriers(slices, self.mtp.shapes))
            if draft_check is not None:
                found = draft_check.verify(rollout, drafter=True)
                metrics["sync/served_draft_checked"] = found["sync/served_checked"]
        except Exception as exc:  # noqa: BLE001 (raised by the caller after the agreement round)
            return exc
        metrics["sync/draft_tensors"], metrics["sync/draft_bytes"] = float(info["tensors"]), float(self.mtp.nbytes)
        return None

    @staticmethod
    def _verify(check: ServedCheck, rollout, metrics: Dict[str, float]) -> Optional[BaseException]:
        """The served-weights check (this rank's engine, and a drafter kept in step with the policy);
        its error is agreed with the other ranks like a failed load."""
        try:
            metrics.update(check.verify(rollout))
            drafted = getattr(rollout, "drafter_weight_names", None)
            if drafted:
                metrics["sync/served_seconds"] += check.verify(rollout, drafter=True, names=drafted)[
                    "sync/served_seconds"]
        except Exception as exc:  # noqa: BLE001 (raised by the caller after the agreement round)
            return exc
        return None

    def _run_full(self, actor, rollout, check: Optional[ServedCheck] = None):
        cut = None
        if check is not None:
            cut, comparable = served_check.full_cut(rollout)
            check = check if comparable else None
        # resident until load_weights has returned: only then may the actor offload (held_resident)
        with held_resident(actor):
            stream = BucketStream(in_dtype(export_source(actor)(), getattr(rollout, "weight_dtype", None)),
                                  self.bucket_bytes)
            items = check.expect_full(iter(stream), cut) if check is not None else iter(stream)
            error = _feed(stream, lambda: rollout.load_weights(items),
                          f"{type(rollout).__name__}.load_weights")
        return error, stream, {
            "sync/sliced": 0.0,
            "sync/bytes": float(stream.bytes),
            "sync/buckets": float(stream.buckets),
            "sync/peak_bucket_bytes": float(stream.peak_bucket_bytes),
            "sync/largest_tensor_bytes": float(stream.largest_tensor_bytes),
        }

    def _run_sliced(self, source, rollout, check: Optional[ServedCheck] = None):
        keeps = rollout.weight_slices() if callable(getattr(rollout, "weight_slices", None)) else (0, 1)
        with source() as model:
            dtype = getattr(rollout, "weight_dtype", None) or holdings(model).dtype()
            self.sliced.prepare(model, keeps, dtype)  # PlanError escapes before any exchange
            stream = SourceStream(self.sliced.stream(model, keeps, dtype))
            items = check.expect(iter(stream)) if check is not None else iter(stream)
            if hasattr(rollout, "load_weight_slices"):
                error = _feed(stream, lambda: rollout.load_weight_slices(items),
                              f"{type(rollout).__name__}.load_weight_slices")
            else:
                error = _feed(stream, lambda: rollout.load_weights(carriers(items, self.sliced.plan.shapes)),
                              f"{type(rollout).__name__}.load_weights")
        c = self.sliced.counts
        return error, stream, {
            "sync/sliced": 1.0,
            "sync/bytes": float(c["received"]),  # this rank's slices (or their deltas), itself included
            "sync/wire_bytes": float(c["wire"]),  # of those, from other ranks
            "sync/dense_bytes": float(c["dense"]),  # its slices in full
            "sync/sent_bytes": float(c["sent"]),
            "sync/changed_fraction": c["changed"] / max(c["elements"], 1),
            "sync/buckets": float(len(self.sliced.plan.buckets)),
            # one bucket's send + receive buffers (two buckets are in flight: the next one's
            # exchange overlaps this one's loading); the largest full tensor (a loader's carrier)
            "sync/peak_bucket_bytes": float(c["peak_bucket"]),
            "sync/largest_tensor_bytes": float(c["largest"]),
        }


def sync(actor, rollout, *, bucket_mb: Optional[float] = None, bucket_bytes: Optional[int] = None,
         mode: str = "auto", delta: bool = False) -> Dict[str, float]:
    """One weight sync (see the module docstring); a collective over all ranks of the job."""
    return WeightSync(bucket_mb=bucket_mb, bucket_bytes=bucket_bytes, mode=mode, delta=delta)(actor, rollout)
