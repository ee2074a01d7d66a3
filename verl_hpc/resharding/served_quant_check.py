"""The served-weights check under `rollout.quantization`, the expected side (docs/quantization.md).

vLLM quantizes each linear layer itself when it loads the sent tensors, so what it serves for
`model.layers.0.mlp.gate_proj.weight` is FP8 values and scales, not the bf16 slice the sync sent.
The expected side makes the same of the sent slice with an independent reference quantizer
(resharding/quant_reference.py) and compares bitwise, tensor for tensor:

- before a checked sync it asks the engine once where each checkpoint tensor sits in a quantizable
  linear layer (rollout/vllm/served_quant.py: the layer, its rows in it, the layer's dtype);
- as the slices pass, a fused layer's parts (q, k, v; gate, up) are held until all have arrived,
  then stacked in the engine's row order, cast to the layer's dtype and quantized whole (a per-tensor
  scale covers the fused layer), and each part's rows of the values and of the scales are digested
  under its name and `name:scale`; the copies go. With the stream in layer order, one layer's parts
  at most are held;
- after the sync the engine's values and scales are read back (a quantized layer is read raw, not
  probed) and compared; a quantizable layer the engine serves unquantized, or quantized by another
  method, is named with the precision it is served at.

Layers that stay in high precision (embedding, output head, norms, an MoE router) are compared as
without quantization. At rollout TP > 1 a layer whose scale vLLM reduces over the TP ranks (a
per-tensor scale of a split layer; a per-channel scale of a row-parallel one) is not compared (this
rank's part does not give the scale) and is counted unplaced, with why.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from verl_hpc.resharding.quant_reference import QUANTIZERS, quantize
from verl_hpc.rollout.vllm.served_quant import SCALE, scale_rows

NONE = "none"
__all__ = ["SCALE", "QuantExpectation"]


def mx_exponent() -> str:
    """The installed vLLM's MXFP8 exponent rule (quant_reference.mxfp8): the OCP paper's before 0.32,
    the saturating one since (the nearest verified release's, rollout/vllm/versions.py)."""
    from verl_hpc.rollout.vllm import versions

    return "amax" if versions.parse(versions.release().version) < (0, 32, 0) else "saturating"


class QuantExpectation:
    def __init__(self):
        self.method = NONE
        self.layout: Optional[Dict[str, tuple]] = None  # name -> (layer, start, stop, rows, cols, dtype, split)
        self._held: Dict[str, Dict[str, Tuple[int, torch.Tensor]]] = {}
        self.unchecked: List[str] = []

    def prepare(self, rollout) -> None:
        method = getattr(rollout, "quantization", NONE) or NONE
        if method != self.method:
            self.method, self.layout = method, None
        if self.method == NONE or self.layout is not None:
            return
        from verl_hpc.rollout.vllm.quantization import quantizes_linear

        # the engine's whole checkpoint (names=None): asked once, the layout does not change between syncs
        self.layout = rollout.served_weights(None, None, layout=True) if quantizes_linear(self.method) else {}

    def reset(self) -> None:
        self._held, self.unchecked = {}, []

    def holds(self, name: str) -> bool:
        return bool(self.layout) and name in self.layout

    def _reduced(self, split) -> bool:
        """vLLM reduces this layer's scales over the TP ranks (quant_reference.py's last paragraph)."""
        split_in, split_out = split
        return {"fp8_per_tensor": split_in or split_out, "fp8_per_channel": split_in}.get(self.method, False)

    def add(self, name: str, part: torch.Tensor, digest) -> Dict[str, tuple]:
        """Take one sent part; once its layer is complete, the expected entries of all its parts."""
        layer, start, stop, rows, cols, dtype, split = self.layout[name]
        if self.method not in QUANTIZERS:
            raise KeyError(f"rollout.quantization = {self.method}: no reference quantizer (known: "
                           f"{', '.join(QUANTIZERS)}); set resharding.check_served = false to run unchecked")
        if self._reduced(split):
            self.unchecked.append(f"{name} (its {self.method} scale spans the rollout's TP ranks)")
            return {}
        held = self._held.setdefault(layer, {})
        held[name] = (start, part.detach().to(getattr(torch, dtype), copy=True))
        if sum(p.shape[0] for _, p in held.values()) < rows:
            return {}
        parts = sorted(held.items(), key=lambda kv: kv[1][0])
        values, scales = quantize(self.method, torch.cat([p for _, (_, p) in parts]), mx_exponent())
        del self._held[layer]
        out = {}
        for part_name, (first, p) in parts:
            last = first + p.shape[0]
            lo, hi = scale_rows(self.method, first, last)
            for key, t in ((part_name, values[first:last]), (part_name + SCALE, scales[lo:hi])):
                t = t.contiguous()
                out[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), digest(t))
        return out

    def precision_problem(self, entry, what: str, dtype: str) -> Optional[str]:
        """The precision a quantizable tensor is served at, where it is not the method's: None if it is."""
        if self.method == NONE or not self.holds(entry.name.split(SCALE)[0]):
            return None
        if entry.dtype != dtype:
            return (f"the {what} serves {entry.name} as {entry.dtype} ({entry.source}), but rollout.quantization = "
                    f"{self.method} serves it as {dtype}: the layer runs at another precision than claimed "
                    "(left unquantized by vLLM's quantization config?)")
        if not entry.name.endswith(SCALE) and f"({self.method})" not in entry.source:
            return (f"the {what} serves {entry.name} quantized by another method ({entry.source}) than "
                    f"rollout.quantization = {self.method}")
        return None
