"""Reference quantizers for the served-weights check under `rollout.quantization`: plain torch,
written from each method's definition (docs/quantization.md), not vLLM's code, so that what the
rollout engine serves is compared with what an independent quantizer makes of the trainer's export.

Each takes one linear layer's weight as this rank's engine holds it before quantizing (output rows x
input columns, in the rollout's dtype, a fused layer's parts stacked in the engine's order) and
returns (values, scales) as the method stores them for its forward pass:

    method            values                 scales                                   bitwise
    fp8_per_tensor    float8_e4m3fn, W x 1/s  float32 [1]: s = amax(|W|) / 448          yes (the
                                                                                         reciprocal, as
                                                                                         the kernel)
    fp8_per_channel   float8_e4m3fn, W / s_r  float32 [rows, 1]: s_r = amax_row / 448,   yes
                                              at least 1 / (448 x 512)
    fp8_per_block     float8_e4m3fn, W x 1/s_b  float32 [ceil(rows/128), ceil(cols/128)]: yes
                                              s_b = max(amax of the 128 x 128 block, 1e-4) / 448
    mxfp8             float8_e4m3fn, W / 2^e   uint8 [rows, cols/32]: the biased exponent  yes
                                              e + 127 in [0, 254], e = ceil(log2(amax of 32 / 448))
                                              (vLLM 0.32; 0.25: floor(log2(amax of 32)))

float8_e4m3fn's largest finite value is 448; a value is saturated to +-448 where the method clamps
(per tensor and per channel) and rounded to nearest even. All four are deterministic element-wise
arithmetic on IEEE floats, so the comparison is bitwise: a difference is a different weight, a
different scale, or a layer quantized by another method (or not at all).

At rollout TP > 1 vLLM reduces the amax over the tensor-parallel ranks where a shard does not hold
every element a scale covers (a per-tensor scale; a per-channel scale of a row-parallel layer); this
rank's part alone does not give that scale, and the check leaves such layers uncompared (counted
unplaced, resharding/served_check.py).
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
BLOCK = 128  # fp8_per_block: 128 x 128 blocks
MX_BLOCK = 32  # mxfp8: 32 consecutive elements of a row share an exponent
MX_EXPONENTS = ("saturating", "amax")  # mxfp8's shared-exponent rules (`mxfp8`)


def _fp8_max(device) -> torch.Tensor:
    # a 0-d float32 divisor: true division, as the method defines the scale (not x times 1/448)
    return torch.tensor(FP8_MAX, dtype=torch.float32, device=device)


def _amax(w: torch.Tensor, dim=None) -> torch.Tensor:
    lo, hi = w.aminmax() if dim is None else w.aminmax(dim=dim, keepdim=True)
    return torch.maximum(lo.abs(), hi.abs())


def fp8_per_tensor(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    scale = _amax(w).reshape(1).to(torch.float32) / _fp8_max(w.device)
    inv = 1.0 / scale
    return (w.to(torch.float32) * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_per_channel(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    top = _fp8_max(w.device)
    scale = (_amax(w, dim=-1).to(torch.float32) / top).clamp_min(1.0 / (top * 512))
    return (w.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_per_block(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    padded = torch.zeros((-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK), dtype=w.dtype, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(-1, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    amax = blocks.abs().to(torch.float32).amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scale = (amax / FP8_MAX).view(blocks.shape[0], blocks.shape[2])
    q = (blocks.to(torch.float32) * (1.0 / scale.view(blocks.shape[0], 1, blocks.shape[2], 1))).to(FP8)
    return q.view_as(padded)[:rows, :cols].contiguous(), scale


def mxfp8(w: torch.Tensor, exponent: str = "saturating") -> Tuple[torch.Tensor, torch.Tensor]:
    """`exponent`: saturating (the block's amax lands at the top of e4m3's range: ceil(log2(amax /
    448)), vLLM 0.32) or amax (the OCP MX paper's floor(log2(amax)), which puts the amax near 1 and
    the small elements in the subnormals: vLLM 0.25)."""
    rows, cols = w.shape
    blocks = w.to(torch.float32).view(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    if exponent not in MX_EXPONENTS:
        raise ValueError(f"mxfp8 exponent {exponent!r}: one of {', '.join(MX_EXPONENTS)}")
    e = torch.ceil(torch.log2(amax / FP8_MAX)) if exponent == "saturating" else torch.floor(torch.log2(amax))
    biased = (e + 127.0).clamp(0, 254)
    q = (blocks / torch.exp2(biased - 127.0).unsqueeze(-1)).view(rows, cols).to(FP8)
    return q, biased.to(torch.uint8)


QUANTIZERS: Dict[str, Callable] = {"fp8_per_tensor": fp8_per_tensor, "fp8_per_channel": fp8_per_channel,
                                   "fp8_per_block": fp8_per_block, "mxfp8": mxfp8}


def quantize(method: str, w: torch.Tensor, mx_exponent: str = "saturating") -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of `method` for the layer weight `w` (output rows x input columns);
    `mx_exponent`: mxfp8's exponent rule (the vLLM release's)."""
    if method not in QUANTIZERS:
        raise KeyError(f"no reference quantizer for {method!r}; known: {', '.join(QUANTIZERS)}")
    return mxfp8(w, mx_exponent) if method == "mxfp8" else QUANTIZERS[method](w)
