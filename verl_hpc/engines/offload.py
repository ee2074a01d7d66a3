"""Host offload of an engine's parameters, gradient buffers and optimizer states while it is idle.

    off = Offloader(engine, params=True, grads=True, optimizer=True)
    off.offload()                      # after the role's phase
    with off.resident("forward"): ...  # weights back for log-probs / values / export
    with off.resident("state"): ...    # weights and optimizer states: a checkpoint's save or load
    with off.resident("train"): ...    # everything back for an update

How: every tensor an engine holds lives in a few storages (Megatron's DDP keeps all parameters in
one contiguous param buffer and all main grads in one fp32 grad buffer per chunk; the optimizer's
Adam moments and fp32 master shards are separate tensors). Offloading copies a storage's bytes to
a host buffer (pinned where a GPU exists, so the copies run at PCIe speed) and shrinks the storage
to 0 bytes; every tensor viewing it keeps its shape, strides and identity, so Megatron's DDP hooks,
the optimizer's param groups and the distributed optimizer's shard views stay valid. Onloading
grows the storage back and copies the bytes in: the values are bit-for-bit those offloaded, so
offload cannot change results. This is what verl's Megatron workers do with the same buffers; it
is written here because megatron-core 0.16 has no offload of idle model states (its
`cpu_offloading` moves activations during a step, a different thing), and FSDP2's CPU offload
policy keeps parameters on the host even while the role computes (a per-layer copy each forward
and an optimizer step on the CPU: `fsdp.cpu_offload`), which is for a model that does not fit
while it trains, not for a role that waits. The FSDP engine's parameters are DTensors whose local
shards view one storage per layer group: the same storage trick keeps FSDP's views valid.

Gradient buffers are zeroed at the start of every update (MegatronEngine.forward_backward), so
their bytes are dropped, not copied: they need no host memory. On a CPU-only machine the host
buffer and the device are the same memory: the mechanism runs (and is tested) but saves nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, List

import torch

from verl_hpc.runtime.device import has_gpu

KINDS = ("params", "grads", "optimizer")
# what each use of the engine needs on the device; a checkpoint holds no gradients, so a save or a
# load leaves the gradient buffers dropped (on a GPU that is the fp32 size of the model not mapped
# while the state is copied)
RESIDENT = {"forward": ("params",), "state": ("params", "optimizer"), "train": KINDS}


@dataclasses.dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    host: torch.Tensor = None  # uint8 [nbytes] while offloaded (None for dropped grads)


def _u8(storage: torch.UntypedStorage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _storages(tensors, seen: set) -> List[_Slot]:
    out = []
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in seen or s.nbytes() == 0:
            continue
        seen.add(key)
        out.append(_Slot(s, s.nbytes(), t.device))
    return out


def engine_tensors(engine) -> Dict[str, list]:
    """The engine's parameters, main grads and optimizer tensors (which may overlap: the caller
    dedupes by storage in the order params, grads, optimizer). An engine that holds its tensors
    otherwise says which they are (`offload_tensors()`: the FSDP engine's local shards)."""
    own = getattr(engine, "offload_tensors", None)
    if own is not None:
        return own()
    params = list(engine._parameters())
    grads = [getattr(p, "main_grad", None) for p in params]
    opt: list = []
    if engine.optimizer is not None:
        for o in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            inner = getattr(o, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                opt += list(group["params"])  # fp32 master shards (distributed optimizer, bf16)
            for state in inner.state.values():
                opt += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {"params": params, "grads": grads, "optimizer": opt}


class Offloader:
    def __init__(self, engine, *, params: bool = False, grads: bool = False, optimizer: bool = False):
        self.engine = engine
        self.enabled = {"params": params, "grads": grads, "optimizer": optimizer}
        self.pin = has_gpu()
        self.slots: Dict[str, List[_Slot]] = {k: [] for k in KINDS}
        self.offloaded = {k: False for k in KINDS}
        self.depth = 0  # nested resident() blocks: only the outermost offloads on exit

    @property
    def any(self) -> bool:
        return any(self.enabled.values())

    def _collect(self) -> None:
        """The storages of every kind that is on the device now. Collected afresh before every
        offload: Adam's states appear at the first optimizer step, or when a checkpoint save or load
        creates them (state.ensure_optimizer_state) while the gradients stay offloaded. An offloaded
        kind keeps its slots (its storages are empty, so the others' dedupe skips them)."""
        seen: set = set()
        tensors = engine_tensors(self.engine)
        for kind in KINDS:
            slots = _storages(tensors[kind], seen)
            if not self.offloaded[kind]:
                self.slots[kind] = slots

    def offload(self) -> None:
        """Move every enabled kind to the host (no-op for kinds already there)."""
        if not self.any:
            return
        self._collect()
        for kind in KINDS:
            if not self.enabled[kind] or self.offloaded[kind]:
                continue
            for slot in self.slots[kind]:
                if kind != "grads":
                    src = _u8(slot.storage, slot.device)
                    slot.host = torch.empty(slot.nbytes, dtype=torch.uint8, pin_memory=self.pin)
                    slot.host.copy_(src, non_blocking=self.pin)
            if self.pin:
                from verl_hpc.runtime.device import synchronize

                synchronize()
            for slot in self.slots[kind]:
                slot.storage.resize_(0)
            self.offloaded[kind] = True

    def onload(self, kinds=KINDS) -> None:
        moved = False
        for kind in kinds:
            if not self.offloaded[kind]:
                continue
            moved = True
            for slot in self.slots[kind]:
                slot.storage.resize_(slot.nbytes)
                dst = _u8(slot.storage, slot.device)
                if slot.host is None:
                    dst.zero_()  # dropped grads: the update zeroes them anyway
                else:
                    dst.copy_(slot.host, non_blocking=self.pin)
                    slot.host = None
            self.offloaded[kind] = False
        if self.pin and moved:  # nothing copied (nothing offloaded, as every step of a resident role): no wait
            from verl_hpc.runtime.device import synchronize

            synchronize()

    @contextlib.contextmanager
    def resident(self, what: str = "train") -> Iterator[None]:
        """Bring back what `what` needs (RESIDENT: forward, state or train), offload on exit
        (the outermost block only: a nested one keeps what the outer one brought back)."""
        if what not in RESIDENT:
            raise ValueError(f"resident({what!r}); valid: {', '.join(RESIDENT)}")
        self.onload(RESIDENT[what])
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.offload()

    def device_bytes(self) -> Dict[str, int]:
        """Bytes of each kind currently in its (device) storages: what the role keeps resident."""
        seen: set = set()
        tensors = engine_tensors(self.engine)
        return {kind: sum(s.storage.nbytes() for s in _storages_all(tensors[kind], seen))
                for kind in KINDS}


def _storages_all(tensors, seen: set) -> List[_Slot]:
    """Like _storages but counting empty (offloaded) storages too, as 0 bytes."""
    out = []
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), id(s)) if s.nbytes() == 0 else s.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out.append(_Slot(s, s.nbytes(), t.device))
    return out
