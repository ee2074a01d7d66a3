"""Stand-ins for a rollout engine on the receiving end of a sync: they take `load_weights` like
VLLMRollout and HFRollout do (one lazy iterator of (hf_name, full tensor)) and keep nothing of
the model. For measuring the resharding step without an inference engine's own loading cost
(benchmarks/bench_resharding.py), and for checking what a sync delivers (tests).

    NullSink     consumes and drops every tensor (the transport alone)
    DigestSink   records name, shape, dtype and a SHA-1 of every tensor's bytes, in order: two
                 syncs delivered the same weights iff their digests are equal (bitwise)
    SliceSink    keeps the slices an inference-TP rank would keep (the sliced sync's
                 `load_weight_slices`), to compare with the same slices of the full tensors
"""
from __future__ import annotations

import hashlib
import time
from typing import Dict, Iterable, List, Tuple

import torch


class NullSink:
    name = "null"

    def __init__(self):
        self.loads = 0

    def weight_slices(self):
        return 0, 1  # takes whole tensors

    def wake(self, tags=None) -> None:
        pass

    def sleep(self) -> None:
        pass

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Dict[str, float]:
        start, tensors, nbytes = time.perf_counter(), 0, 0
        for _, tensor in weights:
            tensors += 1
            nbytes += tensor.numel() * tensor.element_size()
        self.loads += 1
        return dict(tensors=tensors, bytes=nbytes, seconds=time.perf_counter() - start)


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-1 of the tensor's bytes in row-major order (its dtype's bit patterns, so -0.0 != 0.0
    and NaN payloads count: a bitwise comparison)."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha1(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


class DigestSink(NullSink):
    name = "digest"

    def __init__(self):
        super().__init__()
        self.records: List[Tuple[str, List[int], str, str]] = []

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Dict[str, float]:
        start = time.perf_counter()
        self.records = [(name, list(t.shape), str(t.dtype).replace("torch.", ""), tensor_digest(t))
                        for name, t in weights]
        self.loads += 1
        return dict(tensors=len(self.records), seconds=time.perf_counter() - start)

    def digests(self) -> Dict[str, str]:
        return {name: digest for name, _, _, digest in self.records}


class SliceSink(NullSink):
    """Keeps (a copy of) every slice it is given, as inference-TP rank `tp_rank` of `tp`."""

    name = "slices"

    def __init__(self, tp_rank: int = 0, tp: int = 1):
        super().__init__()
        self.keeps = (tp_rank, tp)
        self.slices: Dict[str, Tuple[int, int, int, torch.Tensor]] = {}  # name -> (dim, start, stop, part)

    def weight_slices(self):
        return self.keeps

    def load_weight_slices(self, items) -> Dict[str, float]:
        start = time.perf_counter()
        self.slices = {name: (need.dim, need.start, need.stop, part.clone()) for name, part, need in items}
        self.loads += 1
        return dict(tensors=len(self.slices), seconds=time.perf_counter() - start)

    def mismatches(self, full: Dict[str, torch.Tensor]) -> List[str]:
        """Names whose slice is not bitwise the same part of `full[name]` (cast to the slice's
        dtype), plus names missing on either side."""
        bad = sorted(set(full) ^ set(self.slices))
        for name, (dim, lo, hi, part) in self.slices.items():
            if name in full:
                want = full[name].narrow(dim, lo, hi - lo).to(part.dtype)
                if tensor_digest(want) != tensor_digest(part) or want.shape != part.shape:
                    bad.append(name)
        return bad
