"""Delta encoding for the weight sync: only the elements whose bits changed since the last sync.

    mode, count, payload = encode(new, prev)          # sender; prev None: dense
    decode(mode, count, payload, mirror)              # receiver, in place on its copy
    checksum(t) == checksum(mirror)                   # both sides agree bit for bit

Elements are compared as bit patterns in the wire dtype (the rollout's dtype): a bf16 rollout
sees a weight change only when the update moves its bf16 value, which for small learning rates is
a few per cent of the elements per step. Three encodings, the smallest chosen per transfer:
    DENSE   every element (n * s bytes)
    INDEX   int32 positions and their values (k * (4 + s))
    BITMAP  one bit per element, then the values of the set bits (n / 8 + k * s)
so a delta never costs more than the dense slice.

The checksum guards the transfer (it is not cryptographic): on the host, zlib's CRC32 of the
bytes (C, ~1 GB/s per core, no copy); on a GPU, where copying every slice to the host would cost
more than the transfer saved, a weighted sum of the elements' bit patterns with odd 64-bit
weights in wrapping int64 arithmetic, in chunks: any single changed element changes it (an odd
weight is invertible modulo 2^64). That one is written here because no library offers a
device-side hash of a tensor's bits. Both sides of a transfer hold the slice on the same kind of
device, so they compute the same kind of checksum.
"""
from __future__ import annotations

import zlib
from typing import Optional, Tuple

import torch

DENSE, INDEX, BITMAP = 0, 1, 2
MODES = {DENSE: "dense", INDEX: "index", BITMAP: "bitmap"}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / phi as a signed int64


def bits(t: torch.Tensor) -> torch.Tensor:
    """The flat elements as integers of the same width (their bit patterns)."""
    return t.reshape(-1).view(_INT[t.element_size()])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


CHUNK = 1 << 24  # elements per step of the device checksum (bounds its int64 temporaries)


def checksum(t: torch.Tensor) -> int:
    t = t.contiguous()
    if t.device.type == "cpu":
        return zlib.crc32(as_bytes(t).numpy())
    return weighted_sum(t)


def weighted_sum(t: torch.Tensor) -> int:
    """The device checksum (module docstring); runs on any device, used off the host."""
    b, total = bits(t.contiguous()), torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, b.numel(), CHUNK):
        part = b[start:start + CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=t.device) * _GOLDEN * 2 + 1
        total += (part * weights).sum()
    return int(total)


def encode(new: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[int, int, torch.Tensor]:
    """(mode, changed count, payload bytes) for a contiguous `new` against `prev` (same shape and
    dtype; None: no previous sync, dense)."""
    n, size = new.numel(), new.element_size()
    if prev is None:
        return DENSE, n, as_bytes(new)
    changed = bits(new) != bits(prev)
    k = int(torch.count_nonzero(changed))  # (bool.sum() is ~20x slower on CPU)
    costs = {DENSE: n * size, INDEX: k * (4 + size), BITMAP: -(-n // 8) + k * size}
    mode = min(costs, key=lambda m: (costs[m], m))
    if mode == DENSE:
        return DENSE, k, as_bytes(new)
    values = as_bytes(new.reshape(-1)[changed])
    if mode == INDEX:
        where = changed.nonzero().reshape(-1).to(torch.int32)
        return INDEX, k, torch.cat([as_bytes(where), values])
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=new.device)
    padded[:n] = changed
    packed = (padded.view(-1, 8) * _BITS.to(new.device)).sum(dim=1, dtype=torch.uint8)
    return BITMAP, k, torch.cat([packed, values])


def payload_bytes(mode: int, count: int, n: int, element_size: int) -> int:
    if mode == DENSE:
        return n * element_size
    if mode == INDEX:
        return count * (4 + element_size)
    if mode == BITMAP:
        return -(-n // 8) + count * element_size
    raise ValueError(f"unknown delta mode {mode}")


def decode(mode: int, count: int, payload: torch.Tensor, out: torch.Tensor) -> None:
    """Apply a payload to `out` (contiguous, the receiver's copy of the slice) in place."""
    flat, size = out.reshape(-1), out.element_size()
    if mode == DENSE:
        as_bytes(flat).copy_(payload)
        return
    # the payload sits at any byte offset of its bucket: its parts are copied before a typed view
    if mode == INDEX:
        where = payload[:count * 4].clone().view(torch.int32).to(torch.int64)
        flat[where] = payload[count * 4:].clone().view(out.dtype)
        return
    head = -(-flat.numel() // 8)
    unpacked = (payload[:head].unsqueeze(1) & _BITS.to(payload.device)) != 0
    changed = unpacked.reshape(-1)[:flat.numel()]
    flat[changed] = payload[head:head + count * size].clone().view(out.dtype)
