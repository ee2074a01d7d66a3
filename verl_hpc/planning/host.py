"""Host bytes of one rank beyond its process: offloaded states, vLLM's sleeping copies, checkpoints.

Pinned buffers (torch's CachingHostAllocator) are rounded up to a power of two each
(hardware.pinned) and, once freed, stay cached for the next allocation of that size: what was
pinned once is held for the process's life. So the offload copies, vLLM's sleep copies and the
async saver's snapshots are counted in every phase, each buffer rounded:
- offload (engines/offload.py): one pinned buffer per storage: a trainable role's
  weights live in DDP's contiguous param buffer (one per model chunk: vpp chunks), a frozen role's
  in one storage per tensor; Adam's fp32 master shard and two moments are tensors of their own,
  per parameter (sharded over DP by the distributed optimizer); gradients are dropped, not copied;
- vLLM asleep (vLLM 0.32 CuMemBackend.suspend): its CUDA graphs and runtime pool at every level,
  its weights (one allocation per tensor) at level 1;
- checkpoint (checkpoint/trainer_state.py maybe_save): every saved role's state (weights +
  optimizer) is gathered in one list before the save. A role that offloads copies it to plain
  (unpinned) host tensors inside `engine.state()`; one that does not hands device views to the
  saver. The async saver (checkpoint/async_save.py) then snapshots each slab into a buffer it keeps
  for the next save (pinned only where the slab is on the device); the synchronous save copies the
  device slabs to the host for the duration of the write;
- rollback's reload reads each slab through one host buffer (at most the largest slab) and two
  64 MiB checksum buffers (checkpoint/rankfile.py).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from verl_hpc.planning import hardware

READ_CHUNK_BYTES = 64 << 20  # checkpoint/rankfile.py CHUNK: the reader's two verify buffers


@dataclasses.dataclass(frozen=True)
class RoleTensors:
    """What the host figures need of one Megatron role on this rank."""

    name: str
    sizes: List[int]  # elements per parameter tensor
    param_bytes: int
    trainable: bool
    chunks: int  # model chunks (vpp), each with its own DDP param buffer
    shard: int  # the distributed optimizer's DP sharding (1 without it)
    optimizer_tensors: int  # fp32 tensors per parameter: 2 Adam moments (+ 1 master copy)
    offload: Dict[str, bool]
    # bytes of each storage a trained role's weights live in, where they are not `chunks` equal
    # buffers (the FSDP engine: each parameter's local shard is a storage of its own)
    buffers: Optional[List[float]] = None

    @property
    def weight_bytes(self) -> float:
        return float(sum(self.sizes) * self.param_bytes)

    @property
    def optimizer_bytes(self) -> float:
        return float(sum(self.sizes) * 4 * self.optimizer_tensors / self.shard) if self.trainable else 0.0

    def offloaded_pinned(self) -> float:
        """Pinned host bytes of what this role offloads, each buffer rounded."""
        total = 0.0
        if self.offload.get("weights"):
            if self.buffers is not None:
                total += sum(hardware.pinned(n) for n in self.buffers)
            elif self.trainable:  # DDP's contiguous param buffer, one per chunk
                total += self.chunks * hardware.pinned(self.weight_bytes / self.chunks)
            else:
                total += sum(hardware.pinned(n * self.param_bytes) for n in self.sizes)
        if self.offload.get("optimizer") and self.trainable:
            total += self.optimizer_tensors * sum(hardware.pinned(n * 4 / self.shard) for n in self.sizes)
        return total

    def snapshot_pinned(self) -> float:
        """Pinned snapshot buffers of this role's slabs (weights + optimizer), each rounded."""
        w = sum(hardware.pinned(n * self.param_bytes) for n in self.sizes)
        o = self.optimizer_tensors * sum(hardware.pinned(n * 4 / self.shard) for n in self.sizes)
        return w + (o if self.trainable else 0.0)

    @property
    def offloads_any(self) -> bool:
        return any(self.offload.values())


def vllm_asleep_host(weight_sizes: List[int], param_bytes: int, level: int, graphs: float) -> float:
    """vLLM's pinned copies while asleep: graphs (+ runtime pool) always, weights at level 1."""
    weights = sum(hardware.pinned(n * param_bytes) for n in weight_sizes) if level == 1 else 0.0
    return weights + graphs


def checkpoint_host(saved: List[RoleTensors], async_save: bool, gpu: bool) -> Dict[str, float]:
    """{"kept": bytes held from the first save on, "transient": bytes held during a save}.
    gpu False (a CPU job): the engine's tensors are host tensors already; nothing is pinned and
    the synchronous save writes them without a copy."""
    kept = transient = 0.0
    for r in saved:
        state = r.weight_bytes + r.optimizer_bytes
        if r.offloads_any:  # engine.state() copies to unpinned host tensors; the snapshot too
            transient += state
            kept += state if async_save else 0.0
        elif async_save:  # snapshots of the slabs, kept: pinned and rounded where on a GPU
            kept += r.snapshot_pinned() if gpu else state
        elif gpu:  # the synchronous save copies device slabs to the host while it writes
            transient += state
    return {"kept": kept, "transient": transient}


def reload_host(saved: List[RoleTensors]) -> float:
    """The reader's buffers during a reload: the largest slab (fp32 optimizer states are the
    widest) and two checksum chunks."""
    largest = max((max(r.sizes) * max(r.param_bytes, 4 / r.shard) for r in saved), default=0)
    return float(largest + 2 * READ_CHUNK_BYTES)
