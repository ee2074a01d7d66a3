"""HDF5 checkpoints: layout-independent, atomic, checksummed; reshard on load. (docs/checkpoints.md)

Format: one HDF5 file per rank plus a JSON index, not one shared file through MPI-IO. Why, for
Lustre/GPFS at 1000 ranks:
- Independent I/O. Each rank writes a file nobody else touches: no byte-range lock traffic on a
  shared file (GPFS tokens, Lustre extent locks), no collective buffering to tune, and no
  collective I/O hang modes. The shared-file route has three that bite exactly at scale
  (docs/platform-notes.md, "HDF5"): a rank with an empty slab (norms and biases at 1000 ranks)
  hangs a collective write; metadata written by one rank is silently lost (all must make
  identical calls); filters need collective writes. A dead or slow rank then stalls all 1000.
- The saving side needs only the serial h5py wheel and three small control collectives; parallel
  HDF5 would have to be built against each site's MPI (Debian's Open MPI has no Lustre/GPFS
  MPI-IO drivers anyway). Measured here both routes write at the same speed.
- 1000 files per checkpoint are few for a metadata server (creates are spread over the save);
  with Lustre striping of 1 per file the files spread over OSTs by themselves. Damage is local:
  a bad file names its rank, and the checksum names the tensor.
- Layout independence comes from the index, not from one file: every piece records its slab
  (offsets + shape) in the global tensor, so any reader layout takes what it needs from the few
  files that hold intersecting pieces. Pieces map to files freely, so "one file per node" (an
  aggregation step for 10k+ ranks) would be a planner change, not a format change.

Public API:
    ShardedTensor(name, local, global_shape=None, offsets=None); ShardedTensor.chunk(...)
    save_checkpoint(root, step, tensors, *, metadata, rank_state, layout, keep_last, group) -> Path
    AsyncSaver(root, timeout_s=..., keep_last=..., group=...).save(step, tensors, ...) / .wait()
    open_checkpoint(path) -> CheckpointReader (.load_tensor, .load_into, .metadata, .rank_state, .verify)
    load_tensor, load_into, read_metadata, read_rank_state, list_tensors, find_latest, resolve
    flat_range_slabs (distributed-optimizer shards -> slabs), capture/restore_rng_state
CLI: python -m verl_hpc.checkpoint {inspect,verify} CKPT
"""
from verl_hpc.checkpoint.async_save import AsyncSaver
from verl_hpc.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointLayoutError,
                                        CheckpointNotFoundError)
from verl_hpc.checkpoint.index import find_latest, resolve
from verl_hpc.checkpoint.load import (CheckpointReader, TensorInfo, checkpoint_step, list_tensors, load_into,
                                      load_tensor, open_checkpoint, read_metadata, read_rank_state)
from verl_hpc.checkpoint.publish import apply_retention, list_checkpoints
from verl_hpc.checkpoint.rng import capture_rng_state, restore_rng_state
from verl_hpc.checkpoint.save import save_checkpoint
from verl_hpc.checkpoint.sharded import ShardedTensor, flat_range_slabs

__all__ = [
    "AsyncSaver", "CheckpointCorruptError", "CheckpointError", "CheckpointLayoutError", "CheckpointNotFoundError",
    "CheckpointReader", "ShardedTensor", "TensorInfo", "apply_retention", "capture_rng_state", "checkpoint_step",
    "find_latest", "flat_range_slabs", "list_checkpoints", "list_tensors", "load_into", "load_tensor",
    "open_checkpoint", "read_metadata", "read_rank_state", "resolve", "restore_rng_state", "save_checkpoint",
]
