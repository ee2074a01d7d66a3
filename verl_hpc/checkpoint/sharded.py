"""What a rank hands to save/load: a named slab of a global tensor, and the box arithmetic on slabs.

A slab is `offsets` (one per dim) plus `shape` into a tensor of `global_shape`. A tensor held whole
by a rank (replicated, e.g. a LayerNorm weight under TP, or every weight across DP replicas) is a
slab with offsets 0 and shape == global_shape; several ranks may hand the same slab, and it is
written once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from verl_hpc.checkpoint.errors import CheckpointLayoutError

Shape = tuple[int, ...]


def volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def intersect(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int],
              b_shape: Sequence[int]) -> Optional[tuple[Shape, Shape]]:
    """The box common to two slabs of the same tensor, or None when it is empty (0-d slabs: the
    one element, always shared)."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_shape, b_off, b_shape))
    shape = tuple(h - l for l, h in zip(lo, hi))
    if any(s <= 0 for s in shape):
        return None
    return lo, shape


def flat_range_slabs(shape: Sequence[int], start: int, stop: int):
    """Split the C-order element range [start, stop) of a tensor of `shape` into boxes.

    Returns [(flat_start, flat_stop, offsets, box_shape)], in order, at most 2*ndim-1 boxes. This
    is how a distributed-optimizer shard (a flat range of a parameter) becomes ShardedTensors:
    `ShardedTensor(name, flat_shard[s - start:e - start].view(box), global_shape, tp_offsets + offs)`.
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= volume(shape):
        raise CheckpointLayoutError(f"flat range [{start}, {stop}) outside a tensor of {volume(shape)} elements")
    if start == stop:
        return []
    if not shape:
        return [(0, 1, (), ())]
    inner = volume(shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    out = []

    def row(i, s, e):  # part of row i, as boxes of height 1
        for fs, fe, off, shp in flat_range_slabs(shape[1:], s, e):
            out.append((i * inner + fs, i * inner + fe, (i,) + off, (1,) + shp))

    if r0:
        if i0 == i1:
            row(i0, r0, r1)
            return out
        row(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append((i0 * inner, i1 * inner, (i0,) + (0,) * (len(shape) - 1), (i1 - i0,) + shape[1:]))
    if r1:
        row(i1, 0, r1)
    return out


@dataclasses.dataclass(frozen=True)
class ShardedTensor:
    """`local` is the slab of global tensor `name` at `offsets` (defaults: whole tensor, offsets 0)."""

    name: str
    local: torch.Tensor
    global_shape: Optional[Sequence[int]] = None
    offsets: Optional[Sequence[int]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise CheckpointLayoutError(
                f"tensor {self.name!r}: local must be a torch.Tensor, got {type(self.local).__name__}")
        shape = tuple(self.local.shape)
        gshape = shape if self.global_shape is None else tuple(int(s) for s in self.global_shape)
        offs = (0,) * len(gshape) if self.offsets is None else tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "offsets", offs)
        if not (len(gshape) == len(offs) == len(shape)):
            raise CheckpointLayoutError(
                f"tensor {self.name!r}: local shape {list(shape)}, global_shape {list(gshape)} and offsets "
                f"{list(offs)} must have the same number of dims")
        for d, (o, n, g) in enumerate(zip(offs, shape, gshape)):
            if o < 0 or o + n > g:
                raise CheckpointLayoutError(
                    f"tensor {self.name!r}: slab offsets {list(offs)} + shape {list(shape)} exceed global_shape "
                    f"{list(gshape)} in dim {d}")

    @property
    def shape(self) -> Shape:
        return tuple(self.local.shape)

    @classmethod
    def chunk(cls, name: str, local: torch.Tensor, dim: int, index: int, parts: int) -> "ShardedTensor":
        """Part `index` of `parts` equal parts along `dim` (a TP-split weight: index = tp rank)."""
        gshape = list(local.shape)
        gshape[dim] *= parts
        offs = [0] * local.dim()
        offs[dim] = index * local.shape[dim]
        return cls(name, local, gshape, offs)
