"""Ranks of tests/dist/engines/test_fsdp_parity.py: the FSDP engine at this world size, every check
in one launch (rank start-up costs far more than the checks). Global rank 0 saves what the test
compares (`<check>.pt`: forward outputs, the weights after one step); every rank reports each
check's metrics and how many empty micro-batches it ran (rank{r}.json, eng_ranks.main).

    forward        the actor's log-probs and entropy (temperature 0.7)
    fixed.<model>  one train_step, fixed micro-batches of 2 rows (llama, tied qwen2, and the held-out
                   architectures the test names: one launch covers them too)
    budget         the same batch in micro-batches of a token budget
    uneven         5 rows (so some rank runs an empty micro-batch), one per micro-batch, clipped
    hsdp           4 ranks only: fsdp.shard_size = 2 (2 replicas x 2 shards), the fixed batch
    vlm.frozen     a tiny Qwen2.5-VL, image rows and a text row, one row per micro-batch (so some
                   rank's micro-batches hold no image, and at 4 ranks one is empty): the vision tower
                   frozen (the default)
"""
from __future__ import annotations

import sys
from pathlib import Path

from eng_ranks import _export, _save, main


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 240):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout,
                        what=f"FSDP parity scenario at {world_size} ranks")


def _engine(args, model: str, optim, **changes):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    opts = dict(optim=OptimConfig(**optim) if optim else None, temperature=args["temperature"], total_steps=4,
                micro_batch_size=2)
    opts.update(changes)
    return FsdpEngine(default_options(args["models"][model], engine="fsdp", **opts))


def check_update(args, workdir, name: str, model: str, batch, optim: dict, **changes) -> dict:
    """One train_step of the policy loss; the weights after it to `<name>.pt`; this rank's
    metrics, its micro-batches and how many of them were empty (run as a zero dummy)."""
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig

    eng = _engine(args, model, optim, **changes)
    planned = []
    plan = eng._microbatches

    def spy(b, rows=None):  # the engine's own plan, as it ran
        mbs = plan(b, rows)
        planned.append([len(mb.rows) for mb in mbs])
        return mbs

    eng._microbatches = spy
    loss = PolicyObjective.from_config(ActorConfig(**args["actor"]))
    metrics = eng.train_step(batch, loss, loss.outputs)
    _save(workdir, name, _export(eng))
    mesh = eng.mesh
    return {"metrics": metrics, "microbatch_rows": planned[0], "mesh": list(mesh.shape),
            "mesh_dims": list(mesh.mesh_dim_names or ())}


def scenario(args, workdir, out: dict) -> None:
    import time

    import torch
    import torch.distributed as dist

    data = torch.load(Path(workdir) / "batch.pt")
    checks = out["checks"] = {}
    optim, clipped = args["optim"], dict(args["optim"], clip_grad=args["clip_grad"])

    def timed(name, fn, *a, **kw):  # the name to the rank's log first (where a hang was)
        print(f"check {name}", flush=True)
        t = time.time()
        result = fn(*a, **kw)
        out["seconds"][name] = time.time() - t
        return result

    def forward():
        eng = _engine(args, "llama", None, trainable=False, micro_batch_size=3)
        _save(workdir, "forward", eng.forward(data["batch"]))

    timed("forward", forward)
    for model in args["fixed"]:
        checks[f"fixed.{model}"] = timed(f"fixed.{model}", check_update, args, workdir, f"fixed.{model}", model,
                                         data["batch"], optim)
    checks["budget"] = timed("budget", check_update, args, workdir, "budget", "llama", data["batch"], optim,
                             max_tokens_per_microbatch=args["max_tokens"])
    checks["uneven"] = timed("uneven", check_update, args, workdir, "uneven", "llama", data["uneven"], clipped,
                             micro_batch_size=1)
    checks["vlm.frozen"] = timed("vlm.frozen", check_update, args, workdir, "vlm.frozen", "vlm", data["vlm"], optim,
                                 micro_batch_size=1)
    if dist.get_world_size() == 4:
        from verl_hpc.config.sections.fsdp import FsdpConfig

        checks["hsdp"] = timed("hsdp", check_update, args, workdir, "hsdp", "llama", data["batch"], optim,
                               fsdp=FsdpConfig(shard_size=2))


if __name__ == "__main__":
    main(sys.argv[1], scenario)
