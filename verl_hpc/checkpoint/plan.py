"""Rank 0's plan for a save: check every rank's slabs against each other, write each slab once.

Input: per rank, the list of `Desc`s of the ShardedTensors it handed to save. Checks: a name means
the same global shape and dtype on every rank; slabs of one tensor are identical or disjoint; they
cover the whole tensor. A slab held by several ranks (replicas) is written by one of them: the
lowest rank ("lowest", the default), or the holder with the fewest bytes so far ("balanced",
which evens out write time when DP replicas hold the weights and only rank 0 of each replica set
would otherwise write them).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from verl_hpc.checkpoint.errors import CheckpointLayoutError
from verl_hpc.checkpoint.sharded import intersect, volume

MAX_REPORTED = 5


@dataclasses.dataclass(frozen=True)
class Desc:
    name: str
    global_shape: tuple
    dtype: str
    offsets: tuple
    shape: tuple
    nbytes: int


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.h5"


def check_name(name: str, what: str = "tensor name") -> None:
    parts = name.split("/") if isinstance(name, str) else [""]
    if not name or "#" in name or any(p in ("", ".", "..") for p in parts):
        raise CheckpointLayoutError(
            f"bad {what} {name!r}: a non-empty string, '/'-separated parts that are not empty, "
            "'.' or '..', and no '#' (it marks a second piece of a tensor on one rank)")


@dataclasses.dataclass
class Plan:
    writes: list          # per rank: [(index into that rank's descs, dataset path in its file)]
    tensors: dict         # index.json "tensors": name -> {global_shape, dtype, pieces: [...]}
    bytes_per_rank: list


def _check_consistent(descs_per_rank) -> dict:
    """name -> (global_shape, dtype), or raise naming the first disagreements."""
    seen: dict = {}
    errors = []
    for rank, descs in enumerate(descs_per_rank):
        for d in descs:
            first = seen.setdefault(d.name, (d.global_shape, d.dtype, rank))
            if first[:2] != (d.global_shape, d.dtype):
                errors.append(f"{d.name!r}: rank {first[2]} says global_shape {list(first[0])} dtype "
                              f"{first[1]}, rank {rank} says {list(d.global_shape)} {d.dtype}")
    groups = {"/".join(n.split("/")[:k]) for n in seen for k in range(1, n.count("/") + 1)}
    errors += [f"{n!r} is both a tensor and a prefix of other tensor names" for n in sorted(groups & set(seen))]
    if errors:
        raise CheckpointLayoutError("inconsistent tensors across ranks: " + "; ".join(errors[:MAX_REPORTED]))
    return {n: v[:2] for n, v in seen.items()}


def _check_partition(name: str, gshape: tuple, slabs: list) -> None:
    """Unique slabs of one tensor must not overlap and must cover it (sweep along dim 0)."""
    ordered = sorted(slabs)
    for i, (off, shp) in enumerate(ordered):
        for off2, shp2 in ordered[i + 1:]:
            if gshape and off2[0] >= off[0] + shp[0]:
                break
            if intersect(off, shp, off2, shp2) is not None:
                raise CheckpointLayoutError(
                    f"tensor {name!r}: slabs at offsets {list(off)} shape {list(shp)} and offsets "
                    f"{list(off2)} shape {list(shp2)} overlap without being equal")
    covered = sum(volume(s) for _, s in ordered)
    if covered != volume(gshape):
        raise CheckpointLayoutError(
            f"tensor {name!r}: the ranks' slabs cover {covered} of its {volume(gshape)} elements "
            f"(global_shape {list(gshape)}); every element must be held by some rank")


def make_plan(descs_per_rank: list, replicas: str = "lowest") -> Plan:
    if replicas not in ("lowest", "balanced"):
        raise CheckpointLayoutError(f"replicas={replicas!r}: valid values are 'lowest' and 'balanced'")
    meta = _check_consistent(descs_per_rank)
    holders: dict = defaultdict(dict)  # (name, offsets, shape) -> {rank: index of its desc}
    for rank, descs in enumerate(descs_per_rank):
        for i, d in enumerate(descs):
            holders[(d.name, d.offsets, d.shape)].setdefault(rank, i)
    slabs_by_name: dict = defaultdict(list)
    for name, off, shp in holders:
        slabs_by_name[name].append((off, shp))
    for name, slabs in slabs_by_name.items():
        _check_partition(name, meta[name][0], slabs)

    nranks = len(descs_per_rank)
    load = [0] * nranks
    owner = {}
    # biggest slabs first: the greedy balance is then close to the best split
    for key in sorted(holders, key=lambda k: (-volume(k[2]), k)):
        ranks = sorted(holders[key])
        nbytes = descs_per_rank[ranks[0]][holders[key][ranks[0]]].nbytes
        if volume(key[2]) == 0 and volume(meta[key[0]][0]) != 0:
            continue  # an empty slab of a non-empty tensor carries nothing
        r = ranks[0] if replicas == "lowest" else min(ranks, key=lambda q: (load[q], q))
        owner[key] = r
        load[r] += nbytes

    writes: list = [[] for _ in range(nranks)]
    tensors = {n: dict(global_shape=list(g), dtype=dt, pieces=[]) for n, (g, dt) in sorted(meta.items())}
    count: dict = defaultdict(int)
    for key in sorted(owner):
        name, off, shp = key
        r = owner[key]
        k = count[(r, name)]
        count[(r, name)] += 1
        dataset = f"tensors/{name}" + (f"#{k}" if k else "")
        writes[r].append((holders[key][r], dataset))
        tensors[name]["pieces"].append(dict(file=rank_file(r), dataset="/" + dataset,
                                            offsets=list(off), shape=list(shp)))
    return Plan(writes=writes, tensors=tensors, bytes_per_rank=load)
