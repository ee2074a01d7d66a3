"""The served-weights check (`resharding.check_served`): after a weight sync, what the rollout engine
serves is read back and compared, tensor by tensor, with what this rank sent it.

A sync can load without an error and serve something else (a reload that lays a tensor out
differently, a tensor left at another precision, a repacked copy gone stale, NaN after a reload);
the rollout then samples from a policy the trainer never had. So at the first sync of a job and every
`check_served_every`-th after it:

    check = ServedCheck(every=100)
    if check.due(sync_index):
        stream = check.expect(items)                  # sliced: (name, this rank's slice, need)
        stream = check.expect_full(items, slicer)     # full: (name, full tensor), cut as the engine cuts
        ...load...
        metrics = check.verify(rollout)               # raises ServedWeightsError naming the tensor

`expect` records a digest of this rank's part of each tensor as it passes (the part the engine's
loader keeps: resharding.plan.RolloutSlicer's cut, which the sliced path sends as it is), `verify`
asks the engine for the digest of what it holds for each name (rollout/vllm/served.py reads it
where the forward pass reads it) and compares dtype, shape and digest. A drafter the sync keeps in
step (rollout.speculative.draft_layers) is read back against the same stream. Names the engine
cannot place (a fused MoE layer's experts) are counted (`sync/served_unplaced`) and named once in
the log, not guessed. Digest: CRC-32 of the bytes on the host, the position-weighted sum of the
delta codec on a device (resharding/delta.py), the same function on both sides.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Iterable, Iterator, Tuple

import torch

from verl_hpc.errors import VerlHpcError
from verl_hpc.resharding.delta import as_bytes, weighted_sum
from verl_hpc.resharding.served_quant_check import SCALE, QuantExpectation

log = logging.getLogger(__name__)


OFF = " (resharding.check_served = false runs without this check)"


class ServedWeightsError(VerlHpcError, RuntimeError):
    """The rollout engine serves other weights than the sync sent it. Raised on the rank that read
    them back; in a job the sync's agreement round turns it into every rank's SyncError (exit 15)."""

    exit_code, kind = 31, "served weights"


def digest(t: torch.Tensor) -> int:
    from verl_hpc.checkpoint.checksum import crc32

    t = t.detach().contiguous()
    if t.device.type == "cpu":
        return int(crc32(as_bytes(t).numpy()))
    return weighted_sum(t)


class ServedCheck:
    def __init__(self, every: int):
        """every: check at the first sync and every `every`-th after it (0: the first only)."""
        self.every = every
        self.expected: Dict[str, Tuple[Tuple[int, ...], str, int]] = {}
        self._said_unplaced = False
        # under rollout.quantization (resharding/served_quant_check.py): the method, where each
        # quantizable name sits (asked of the engine once), a fused layer's parts until all arrived
        self.quant = QuantExpectation()

    def prepare(self, rollout) -> None:
        """Before a checked sync: what the engine quantizes, asked of it once."""
        self.quant.prepare(rollout)

    def due(self, sync_index: int) -> bool:
        """sync_index: syncs done before this one."""
        return sync_index == 0 or (self.every > 0 and sync_index % self.every == 0)

    def _record(self, name: str, part: torch.Tensor) -> None:
        if self.quant.holds(name):  # a quantizable layer's part: the reference quantizer's output instead
            self.expected.update(self.quant.add(name, part, digest))
            return
        self.expected[name] = (tuple(part.shape), str(part.dtype).replace("torch.", ""), digest(part))

    def expect(self, items: Iterable[Tuple[str, torch.Tensor, object]]) -> Iterator[Tuple[str, torch.Tensor, object]]:
        """Sliced items (name, this rank's slice, need) passed on unchanged, each slice's digest kept."""
        self.expected = {}
        self.quant.reset()
        for name, part, need in items:
            self._record(name, part)
            yield name, part, need

    def expect_full(self, items: Iterable[Tuple[str, torch.Tensor]], cut) -> Iterator[Tuple[str, torch.Tensor]]:
        """Full tensors passed on unchanged; `cut(name, shape) -> (dim, start, stop)` is this rank's part
        (the engine's loader keeps it), None for all of it."""
        self.expected = {}
        self.quant.reset()
        for name, tensor in items:
            part = tensor
            if cut is not None:
                dim, start, stop = cut(name, tuple(tensor.shape))
                part = tensor.narrow(dim, start, stop - start)
            self._record(name, part)
            yield name, tensor

    def verify(self, rollout, *, drafter: bool = False, names=None) -> Dict[str, float]:
        """Read back what `rollout` serves for every expected name (or those of `names`: a drafter
        holds part of the policy) and compare; raises ServedWeightsError on the first difference,
        naming the tensor and where vLLM holds it."""
        start = time.perf_counter()
        wanted = {n.split(SCALE)[0] for n in self.expected}  # a part's scales come with its values
        names = sorted(wanted if names is None else set(names) & wanted)
        served, unplaced = rollout.served_weights(names, digest, drafter=drafter)
        unplaced = list(unplaced) + self.quant.unchecked
        what = "drafter" if drafter else "rollout engine"
        for entry in served:
            if entry.name not in self.expected:
                continue  # a layer left uncompared (served_quant_check.py: a scale reduced over TP ranks)
            shape, dtype, value = self.expected[entry.name]
            where = f" (held as {entry.source})" if entry.source != entry.name else ""
            problem = self.quant.precision_problem(entry, what, dtype)
            if problem:
                raise ServedWeightsError(problem + OFF)
            if (tuple(entry.shape), entry.dtype) != (shape, dtype):
                raise ServedWeightsError(
                    f"the {what} serves {entry.name} as {entry.dtype} {list(entry.shape)}{where} but the weight "
                    f"sync sent {dtype} {list(shape)}: it holds another layout or precision than it was given{OFF}")
            if entry.digest != value:
                raise ServedWeightsError(
                    f"the {what} serves other values for {entry.name}{where} than the weight sync sent it: its "
                    f"load or post-load processing changed or lost them{OFF}")
        if unplaced and not self._said_unplaced:
            self._said_unplaced = True
            log.warning("served-weights check: %d tensors have no place the %s's model can be read at (%s%s); "
                        "they are not checked", len(unplaced), what, ", ".join(unplaced[:3]),
                        ", ..." if len(unplaced) > 3 else "")
        return {"sync/served_checked": float(len(served)), "sync/served_unplaced": float(len(unplaced)),
                "sync/served_seconds": time.perf_counter() - start}


def checkable(rollout) -> bool:
    return callable(getattr(rollout, "served_weights", None))


def full_cut(rollout):
    """(cut, comparable) for `expect_full` on the full path: the cut is None where the engine keeps
    whole tensors (rollout TP 1); not comparable where the engine cuts by the model's own
    tensor-parallel plan (vLLM's Transformers backend at TP > 1), which no slicer here describes."""
    tp_rank, tp = rollout.weight_slices() if callable(getattr(rollout, "weight_slices", None)) else (0, 1)
    if tp == 1:
        return None, True
    from verl_hpc.resharding.plan import rollout_slicer

    slicer = rollout_slicer("auto", rollout.model_path, tp)
    if slicer is None:
        return None, False
    return (lambda name, shape: slicer.need(name, shape, tp_rank)), True
