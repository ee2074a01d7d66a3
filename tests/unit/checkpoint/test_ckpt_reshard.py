"""Save at one layout, load at another, in one process: ranks are threads on a ThreadWorld.

A TP2xPP2-like save (row- and column-split weights, TP-replicated norms, a distributed-optimizer
flat shard) loads exactly at 1 rank and at 2 ranks with different splits; a hypothesis property
does the same for random shapes, random uneven grid splits, replicas and random reader grids.
"""
import itertools
import tempfile

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from verl_hpc.checkpoint import ShardedTensor, flat_range_slabs, list_tensors, open_checkpoint, save_checkpoint
from verl_hpc.checkpoint.plan import rank_file


H, FFN, V, LAYERS = 16, 24, 40, 4
PARAMS = {  # name pattern -> (global shape, TP split dim or None for replicated, dtype)
    "embedding.word_embeddings.weight": ((V, H), 0, torch.float32),
    "decoder.layers.{i}.input_layernorm.weight": ((H,), None, torch.float32),
    "decoder.layers.{i}.self_attention.linear_qkv.weight": ((3 * H, H), 0, torch.bfloat16),
    "decoder.layers.{i}.self_attention.linear_proj.weight": ((H, H), 1, torch.bfloat16),
    "decoder.layers.{i}.mlp.linear_fc1.weight": ((2, FFN, H), 1, torch.float32),  # [gate; up] kept apart
    "decoder.layers.{i}.mlp.linear_fc2.weight": ((H, FFN), 1, torch.float32),
    "decoder.final_layernorm.weight": ((H,), None, torch.float32),
    "output_layer.weight": ((V, H), 0, torch.float32),
}


def model_params(pp_rank, pp):
    """(name, global shape, split dim, dtype) of the parameters on one pipeline stage."""
    per = LAYERS // pp
    out = []
    for pattern, (shape, dim, dtype) in PARAMS.items():
        if "{i}" in pattern:
            out += [(pattern.format(i=i), shape, dim, dtype) for i in range(pp_rank * per, (pp_rank + 1) * per)]
        elif (pattern.startswith("embedding") and pp_rank == 0) or (not pattern.startswith("embedding")
                                                                      and pp_rank == pp - 1):
            out.append((pattern, shape, dim, dtype))
    return out


def tp2pp2_rank(rank, full):
    """What rank r of a TP2xPP2 layout hands to save: its TP slices of its stage's parameters, an
    Adam moment of each fc2 weight split as flat ranges between the stage's two ranks (how the
    distributed optimizer shards; the cut is not on a row boundary), and the step counter that
    every rank holds."""
    tp_rank, pp_rank = rank % 2, rank // 2
    tensors = []
    for name, shape, dim, dtype in model_params(pp_rank, 2):
        whole = full(name, shape, dtype)
        if dim is None:
            tensors.append(ShardedTensor(name, whole.clone()))
        else:
            local = whole.chunk(2, dim)[tp_rank].contiguous()
            tensors.append(ShardedTensor.chunk(name, local, dim, tp_rank, 2))
        if name.endswith("linear_fc2.weight"):
            moment = full("optim.exp_avg/" + name, shape).view(-1)
            cut = moment.numel() // 2 - 1
            start, stop = (0, cut) if tp_rank == 0 else (cut, moment.numel())
            for s, e, offs, box in flat_range_slabs(shape, start, stop):
                tensors.append(ShardedTensor("optim.exp_avg/" + name, moment[s:e].clone().view(box), shape, offs))
    tensors.append(ShardedTensor("optim.step", torch.tensor(42, dtype=torch.int64)))
    return tensors


def test_tp2pp2_save_loads_at_one_rank_and_at_two_ranks_with_other_splits(tmp_path, ranks, full, bitwise):
    paths = ranks(4, lambda r, comm: save_checkpoint(tmp_path, 3, tp2pp2_rank(r, full), group=comm,
                                                    layout=dict(tp=2, pp=2, dp=1)))
    assert len(set(paths)) == 1
    infos = list_tensors(tmp_path)
    assert len(infos) == 3 + 5 * LAYERS + LAYERS + 1  # params, fc2 moments, step
    # TP-replicated norms and the step counter are written once, by the lowest rank holding them
    assert [p["file"] for p in infos["decoder.final_layernorm.weight"].pieces] == [rank_file(2)]
    assert [p["file"] for p in infos["optim.step"].pieces] == [rank_file(0)]
    assert len(infos["decoder.layers.0.self_attention.linear_qkv.weight"].pieces) == 2

    with open_checkpoint(tmp_path) as ckpt:  # one rank, everything whole
        for name, info in infos.items():
            want = torch.tensor(42) if name == "optim.step" else full(name, info.global_shape, info.dtype)
            bitwise(ckpt.load_tensor(name), want, name)

    def reader(r, comm):  # two ranks, every tensor cut along its last dim at 1/3
        with open_checkpoint(tmp_path) as ckpt:
            for name, info in infos.items():
                if not info.global_shape:
                    continue
                dim = len(info.global_shape) - 1
                cut = info.global_shape[dim] // 3
                lo, shape = [0] * (dim + 1), list(info.global_shape)
                lo[dim], shape[dim] = (0, cut) if r == 0 else (cut, shape[dim] - cut)
                target = ShardedTensor(name, torch.empty(shape, dtype=info.dtype), info.global_shape, lo)
                ckpt.load_into([target])
                want = full(name, info.global_shape, info.dtype)[tuple(slice(o, o + n) for o, n in zip(lo, shape))]
                bitwise(target.local, want, f"{name} at reader {r}")
        return True

    assert ranks(2, reader) == [True, True]


# ----------------------------------------------------------------------------- properties

def grid(shape, cuts):
    """Boxes of the grid given by sorted cut points per dim: [(offsets, shape)]."""
    edges = [[0, *c, s] for s, c in zip(shape, cuts)]
    spans = [list(zip(e[:-1], e[1:])) for e in edges]
    return [(tuple(a for a, _ in box), tuple(b - a for a, b in box)) for box in itertools.product(*spans)]


@st.composite
def layouts(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))

    def cuts():
        return [sorted(set(draw(st.lists(st.integers(1, s - 1), max_size=2)))) if s > 1 else [] for s in shape]

    writer_cuts, reader_cuts = cuts(), cuts()
    replicas = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    return shape, writer_cuts, reader_cuts, replicas, dtype


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts())
def test_any_grid_split_with_replicas_loads_exactly_at_any_other(layout, ranks, full, bitwise):
    shape, writer_cuts, reader_cuts, replicas, dtype = layout
    whole = full("t", shape, dtype)
    boxes = grid(shape, writer_cuts)
    # each box is held by `replicas` ranks (DP replicas); box k lives on ranks k, k+n, k+2n, ...
    world = len(boxes) * replicas
    assume(world <= 16)  # threads, each writing and fsyncing a file

    def writer(r, comm):
        off, shp = boxes[r % len(boxes)]
        local = whole[tuple(slice(o, o + n) for o, n in zip(off, shp))].clone()
        return save_checkpoint(root, 1, [ShardedTensor("t", local, shape, off)], group=comm,
                               replicas="balanced" if replicas == 3 else "lowest")

    with tempfile.TemporaryDirectory() as root:
        ranks(world, writer)
        with open_checkpoint(root) as ckpt:
            assert len(ckpt.tensors()["t"].pieces) == len(boxes)  # replicas written once
            for off, shp in grid(shape, reader_cuts):
                got = ckpt.load_tensor("t", off, shp)
                bitwise(got, whole[tuple(slice(o, o + n) for o, n in zip(off, shp))], (off, shp))


@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
@settings(max_examples=200, deadline=None)
def test_flat_range_slabs_partition_the_range_in_order(shape, data):
    total = 1
    for s in shape:
        total *= s
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = flat_range_slabs(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    ref = torch.arange(total).view(shape) if shape else torch.tensor(0)
    pos = start
    for s, e, offs, box in boxes:
        assert s == pos and e > s
        region = ref[tuple(slice(o, o + n) for o, n in zip(offs, box))]
        assert torch.equal(region.reshape(-1), torch.arange(s, e))
        pos = e
    assert pos == stop or (not boxes and start == stop)
