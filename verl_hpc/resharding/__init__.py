"""Resharding: the actor's new weights from the Megatron training layout into the in-process
rollout engine, after every update, collectively, in buckets, without disk
(docs/architecture.md, "The RL step").

    from verl_hpc.resharding import WeightSync, sync
    metrics = sync(actor, rollout, bucket_mb=cfg.resharding.bucket_mb)   # every rank, same point
    # or: syncer = WeightSync.from_config(cfg.resharding); metrics = syncer(actor, rollout)

    sync/seconds  sync/bytes  sync/gb_per_s  sync/buckets  sync/peak_bucket_bytes
    sync/tensors  sync/largest_tensor_bytes  sync/export_seconds  sync/load_seconds ...

Modules:
    sync.py      the step: export -> buckets -> load_weights, failure agreement, metrics
    adapter_sync.py  LoRA: the adapter only into the rollout's LoRA slot, and the check that
                 each generation used the synced adapter version
    buckets.py   BucketStream: byte-bounded buckets over a (name, tensor) stream, its counts
    plan.py      SyncPlan: which training rank sends which slice to which rollout rank
    sliced.py    SlicedSync: the plan run bucket by bucket (one all_to_all each), delta option
    delta.py     the delta codec (dense | index | bitmap) and the per-slice checksum
    sinks.py     NullSink / DigestSink / SliceSink: receivers for benchmarks and tests
    memory.py    HeapPeak: the peak extra host memory of a block (glibc heap in use, sampled)

Where the layouts change (docs/resharding.md):
- sliced (resharding.mode sliced, or auto where it applies): a plan computed once from both
  layouts says which training rank sends which part of each HF tensor to which rollout rank; each
  rank receives only the slice its engine keeps (vLLM's cut), one all_to_all per bucket, and with
  resharding.delta only the elements that changed;
- full: Megatron's TP shards are gathered and un-fused into HF tensors and the PP stages
  broadcast theirs (verl_hpc.models.weights.export_hf_weights), so every rank holds each full HF
  tensor in turn and the rollout engine cuts its own slices from them.
Either way training TP and inference TP are independent in both directions.
"""
from verl_hpc.resharding.adapter_sync import AdapterSync, StaleAdapterError, check_generated
from verl_hpc.resharding.buckets import BucketStream, bucket_bytes_from
from verl_hpc.resharding.plan import PlanError
from verl_hpc.resharding.sinks import DigestSink, NullSink, SliceSink
from verl_hpc.resharding.sync import SyncError, WeightSync, export_source, sync

__all__ = ["AdapterSync", "StaleAdapterError", "check_generated", "BucketStream",
           "DigestSink", "NullSink", "PlanError", "SliceSink", "SyncError", "WeightSync", "bucket_bytes_from",
           "export_source", "sync"]
