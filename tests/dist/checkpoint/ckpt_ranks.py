"""Real gloo ranks for the checkpoint tests: `launch(n, scenario, args, workdir)` runs n copies of
this file with torchrun-style variables, each brought up by `verl_hpc.runtime.bootstrap`, and
returns their `rank{r}.json`; `start(...)` returns the processes instead (for kill -9).
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# ----------------------------------------------------------------------------- a TP2xPP2-like model
H, FFN, V, LAYERS = 32, 64, 64, 4
PARAMS = {  # name pattern -> (global shape, TP split dim or None = replicated, dtype name)
    "embedding.word_embeddings.weight": ((V, H), 0, "float32"),
    "decoder.layers.{i}.input_layernorm.weight": ((H,), None, "float32"),
    "decoder.layers.{i}.self_attention.linear_qkv.weight": ((3 * H, H), 0, "bfloat16"),
    "decoder.layers.{i}.self_attention.linear_proj.weight": ((H, H), 1, "bfloat16"),
    "decoder.layers.{i}.mlp.linear_fc1.weight": ((2, FFN, H), 1, "float32"),
    "decoder.layers.{i}.mlp.linear_fc2.weight": ((H, FFN), 1, "float32"),
    "decoder.final_layernorm.weight": ((H,), None, "float32"),
    "output_layer.weight": ((V, H), 0, "float32"),
}


def full_tensor(name, shape, dtype="float32"):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def stage_params(pp_rank, pp):
    per, out = LAYERS // pp, []
    for pattern, (shape, dim, dtype) in PARAMS.items():
        if "{i}" in pattern:
            out += [(pattern.format(i=i), shape, dim, dtype) for i in range(pp_rank * per, (pp_rank + 1) * per)]
        elif pp_rank == (0 if pattern.startswith("embedding") else pp - 1):
            out.append((pattern, shape, dim, dtype))
    return out


def tp2pp2_tensors(rank):
    """Rank r's ShardedTensors: TP slices of its stage's weights, the fc2 Adam moment split as flat
    ranges between the stage's TP ranks (distributed-optimizer style), the step counter."""
    import torch

    from verl_hpc.checkpoint import ShardedTensor, flat_range_slabs

    tp_rank, pp_rank = rank % 2, rank // 2
    out = []
    for name, shape, dim, dtype in stage_params(pp_rank, 2):
        whole = full_tensor(name, shape, dtype)
        if dim is None:
            out.append(ShardedTensor(name, whole))
        else:
            out.append(ShardedTensor.chunk(name, whole.chunk(2, dim)[tp_rank].contiguous(), dim, tp_rank, 2))
        if name.endswith("linear_fc2.weight"):
            moment = full_tensor("optim.exp_avg/" + name, shape).view(-1)
            cut = moment.numel() // 2 - 1
            start, stop = (0, cut) if tp_rank == 0 else (cut, moment.numel())
            for s, e, offs, box in flat_range_slabs(shape, start, stop):
                out.append(ShardedTensor("optim.exp_avg/" + name, moment[s:e].clone().view(box), shape, offs))
    out.append(ShardedTensor("optim.step", torch.tensor(42, dtype=torch.int64)))
    return out


# ----------------------------------------------------------------------------- scenarios (rank side)

def scenario_save(args, ctx):
    """Sync save to args.root, then the same through an AsyncSaver (its own gloo group) to args.root_async."""
    import torch

    from verl_hpc.checkpoint import AsyncSaver, capture_rng_state, save_checkpoint

    tensors = tp2pp2_tensors(ctx.rank)
    state = capture_rng_state(generators={"trainer": ctx.generator})
    state["tag"] = f"rank {ctx.rank}".encode()
    after = torch.rand(3).tolist()  # what a restored torch RNG must draw next
    torch.set_rng_state(torch.from_numpy(state["torch_cpu"]))
    meta = {"config": "parallel:\n  tp: 2\n  pp: 2\n", "trainer_state": {"step": 1}}
    layout = dict(tp=2, pp=2, dp=1, world=4)
    t0 = time.perf_counter()
    path = save_checkpoint(args["root"], 1, tensors, metadata=meta, rank_state=state, layout=layout)
    sync_s = time.perf_counter() - t0
    saver = AsyncSaver(args["root_async"], layout=layout, timeout_s=120)  # collective: creates its gloo group
    saver.save(1, tensors, metadata=meta, rank_state=state)
    blocked = saver.last_blocked_s
    for t in tensors:  # training goes on and changes the weights: the snapshot must not see it
        t.local.add_(1) if t.local.is_floating_point() else t.local.add_(7)
    async_path = saver.wait()
    torch.distributed.barrier()
    # loading is local (no collectives): ranks 0 and 1 now play a 2-rank reader layout
    loaded = load_two_way(args["root"], ctx.rank) if ctx.rank < 2 else None
    return dict(path=str(path), async_path=str(async_path), sync_s=sync_s, async_blocked_s=blocked,
                rng_after=after, loaded=loaded)


def load_two_way(root, reader):
    """Reader `reader` of 2 loads every tensor cut along its last dim at a third (a split no
    writer had) and compares it with the truth."""
    import torch

    from verl_hpc.checkpoint import ShardedTensor, open_checkpoint

    bad = []
    with open_checkpoint(root) as ckpt:
        for name, info in ckpt.tensors().items():
            if not info.global_shape:
                ok = ckpt.load_tensor(name).item() == 42
            else:
                dim = len(info.global_shape) - 1
                cut = info.global_shape[dim] // 3
                lo, shape = [0] * (dim + 1), list(info.global_shape)
                lo[dim], shape[dim] = (0, cut) if reader == 0 else (cut, shape[dim] - cut)
                target = ShardedTensor(name, torch.empty(shape, dtype=info.dtype), info.global_shape, lo)
                ckpt.load_into([target])
                dtype = str(info.dtype).removeprefix("torch.")
                want = full_tensor(name, info.global_shape, dtype)[tuple(slice(o, o + n) for o, n in zip(lo, shape))]
                ok = torch.equal(target.local.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))
            if not ok:
                bad.append(name)
        tags = [ckpt.rank_state(r)["tag"].decode() for r in range(ckpt.world_size)]
    return dict(bad=bad, tags=tags, n=len(ckpt.tensors()))


def scenario_kill(args, ctx):
    """Commit step 1, then start step 2 and stall inside its first big write until killed."""
    import torch

    from verl_hpc.checkpoint import ShardedTensor, rankfile, save_checkpoint

    small = [ShardedTensor.chunk("w", torch.full((4, 8), float(ctx.rank)), 0, ctx.rank, 2)]
    save_checkpoint(args["root"], 1, small)
    real = os.pwrite

    def stalls(fd, data, offset):
        n = real(fd, data, offset)
        Path(args["workdir"], f"writing{ctx.rank}").touch()  # the parent kills us from here on
        time.sleep(120)
        return n

    rankfile.os.pwrite = stalls
    big = [ShardedTensor.chunk(f"big{k}", torch.full((3 << 20, 4), float(k)), 0, ctx.rank, 2) for k in range(2)]
    save_checkpoint(args["root"], 2, big)
    return dict(finished=True)  # never reached


SCENARIOS = {"save": scenario_save, "kill": scenario_kill}


# ----------------------------------------------------------------------------- launching (test side)


def start(world_size: int, scenario: str, args: dict, workdir: Path):
    """The rank processes, running (for kill -9)."""
    from rank_launcher import start_ranks  # tests/: on sys.path under pytest, not in the ranks

    return start_ranks(__file__, world_size, dict(args, workdir=str(workdir)), workdir, argv=[scenario])[1]


def launch(world_size: int, scenario: str, args: dict, workdir: Path, timeout: float = 240):
    from rank_launcher import launch_ranks

    return launch_ranks(__file__, world_size, dict(args, workdir=str(workdir)), workdir,
                        argv=[scenario], timeout=timeout, what=scenario)


def _main(scenario: str, workdir: str) -> None:
    from verl_hpc.runtime import bootstrap, shutdown

    args = json.loads(Path(workdir, "args.json").read_text())
    ctx = bootstrap(backend="gloo", timeout_s=120)
    result = SCENARIOS[scenario](args, ctx)
    Path(workdir, f"rank{ctx.rank}.json").write_text(json.dumps(dict(result, rank=ctx.rank)))
    shutdown()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
