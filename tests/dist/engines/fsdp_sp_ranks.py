"""Ranks of tests/dist/engines/test_fsdp_sp.py: the FSDP engine on 4 gloo ranks with Ulysses
sequence parallelism at fsdp.sp = 1, 2 and 4 (data-parallel 4, 2 and 1), one launch. For each
model and sp, global rank 0 saves `<model>.sp<k>.forward.pt` (log-probs and entropy of the whole
batch) and `<model>.sp<k>.update.pt` (the weights after one train_step); every rank reports the
step's metrics and the attention implementation the model ran (rank{r}.json, eng_ranks.main).
Last, `llama.sp2.budget`: the sp 2 update with micro-batches of a token budget per rank, and
`llama.sp2.hsdp`: sp 2 over HSDP (fsdp.shard_size = 2: 2 replicas x 2 shards).
"""
from __future__ import annotations

import sys
from pathlib import Path

from eng_ranks import _export, _save, main

SPS = (1, 2, 4)


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 300):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout,
                        what=f"FSDP sequence-parallel scenario at {world_size} ranks")


def _engine(args, model: str, sp: int, trainable: bool, **changes):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.config.sections.fsdp import FsdpConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    return FsdpEngine(default_options(args["models"][model], engine="fsdp", trainable=trainable,
                                      optim=OptimConfig(**args["optim"]) if trainable else None,
                                      temperature=args["temperature"], total_steps=4,
                                      **{"micro_batch_size": 1, "fsdp": FsdpConfig(sp=sp), **changes}))


def scenario(args, workdir, out: dict) -> None:
    import time

    import torch

    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig

    batch = torch.load(Path(workdir) / "batch.pt")
    loss = PolicyObjective.from_config(ActorConfig(**args["actor"]))
    checks = out["checks"] = {}
    for model in args["models"]:
        for sp in SPS:
            name = f"{model}.sp{sp}"
            print(f"check {name}", flush=True)  # the name to the rank's log first (where a hang was)
            t = time.time()
            eng = _engine(args, model, sp, trainable=False)
            _save(workdir, f"{name}.forward", eng.forward(batch))
            del eng
            eng = _engine(args, model, sp, trainable=True)
            metrics = eng.train_step(batch, loss, loss.outputs)
            _save(workdir, f"{name}.update", _export(eng))
            checks[name] = {"metrics": metrics, "dp": eng.dp, "attention": eng.model.config._attn_implementation}
            out["seconds"][name] = time.time() - t
    # a token budget per rank: a group of 2 takes twice it per micro-batch (two ~4k rows, not one)
    eng = _engine(args, "llama", 2, trainable=True, max_tokens_per_microbatch=args["budget"])
    metrics = eng.train_step(batch, loss, loss.outputs)
    _save(workdir, "llama.sp2.budget.update", _export(eng))
    checks["llama.sp2.budget"] = {"metrics": metrics, "dp": eng.dp}
    # with HSDP: 2 replicas x shard groups of 2 (the same ranks as the sp groups), a 2-D mesh
    from verl_hpc.config.sections.fsdp import FsdpConfig

    eng = _engine(args, "llama", 2, trainable=True, fsdp=FsdpConfig(sp=2, shard_size=2))
    metrics = eng.train_step(batch, loss, loss.outputs)
    _save(workdir, "llama.sp2.hsdp.update", _export(eng))
    checks["llama.sp2.hsdp"] = {"metrics": metrics, "dp": eng.dp, "mesh": list(eng.mesh.shape)}


if __name__ == "__main__":
    main(sys.argv[1], scenario)
