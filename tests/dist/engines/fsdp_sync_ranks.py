"""Two gloo ranks: the FSDP engine's shards into the sliced (and delta) weight sync.

Each rank builds the FSDP engine (plain FSDP, then HSDP with fsdp.shard_size=1: two replicas), and
syncs into `SliceSink`s standing in for rollout ranks at inference TP 1 and TP 2, before and after
an update, densely and with delta. Each rank writes rank{r}.json: for every case the names whose
slice is not bitwise the same part of the full export (must be none) and the sync's counts.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 240):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="FSDP sliced sync")


def _engine(args, shard_size: int):
    from verl_hpc.config.schema import FsdpConfig, OptimConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    fsdp = FsdpConfig(shard_size=shard_size)
    return FsdpEngine(default_options(args["model"], engine="fsdp", fsdp=fsdp, micro_batch_size=2,
                                      optim=OptimConfig(lr=1e-2)))


def _loss(outs, mb, counts):
    mask = mb["response_mask"]
    return -(outs["log_probs"] * mask).sum() / counts.tokens, {}


def cases(args, rank: int) -> dict:
    import torch

    from verl_hpc.engines.batch import pack_sequences
    from verl_hpc.resharding import SliceSink, WeightSync

    out = {}
    g = torch.Generator().manual_seed(1)
    batch = pack_sequences([torch.randint(5, 480, (4 + i,), generator=g).tolist() for i in range(6)],
                           [torch.randint(5, 480, (3,), generator=g).tolist() for _ in range(6)])
    for shard_size in (0, 1):
        engine = _engine(args, shard_size)
        for tp in (1, 2):
            sink = SliceSink(tp_rank=rank % tp, tp=tp)
            # TP 2 cuts o_proj/down_proj by columns, which FSDP's row shards cannot serve slice
            # by slice: auto falls back to the full path there (checked by the test)
            syncer = WeightSync(bucket_mb=0.05, mode="sliced" if tp == 1 else "auto", delta=True)
            for phase in ("start", "after_update"):
                if phase == "after_update":
                    engine.train_step(batch, _loss)
                metrics = syncer(engine, sink)
                full = {n: t.clone() for n, t in engine.export_hf_weights()}
                out[f"shard{shard_size}/tp{tp}/{phase}"] = dict(
                    mismatches=sink.mismatches(full), sliced=metrics["sync/sliced"],
                    wire=metrics.get("sync/wire_bytes"), bytes=metrics["sync/bytes"],
                    dense=metrics.get("sync/dense_bytes"))
    return out


def main(workdir: Path) -> None:
    import torch.distributed as dist

    from verl_hpc.runtime import bootstrap

    args = json.loads((workdir / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=120, seed=3)
    out = cases(args, ctx.rank)
    (workdir / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
