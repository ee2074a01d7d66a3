"""Ranks of tests/dist/engines/test_eng_vlm.py: the Megatron engine on a tiny Qwen2.5-VL at 4 gloo
ranks, every layout in turn in one launch (rank start-up costs far more than the checks):

    layout    ranks          per layout
    tp1       DP4            forward (log-probs); one update with the vision tower frozen (the
    tp2       TP2 x DP2      default), one with it trained (vision.train_vision_tower); after the
    pp2       PP2 x DP2      trained one, a checksum of every rank's own copy of the tower (its TP
    tp2pp2    TP2 x PP2      replicas must stay equal)
    chain     a checkpoint across engines and layouts (tower frozen):
              Megatron TP2 x DP2: update 1 -> save M1, update 2 -> weights
              FSDP on the 4 ranks: load M1 -> save F0 at once, update 2 -> weights, save F1, update 3
              Megatron TP2 x PP2: load F1 -> save M2 at once, update 3 -> weights

The batch (image rows and a text row, one row per micro-batch, so some rank's micro-batches hold no
image) comes from the test (batch.pt). Global rank 0 saves what the test compares as
`<layout>.<check>.pt`; every rank writes rank{r}.json (eng_ranks.main).
"""
from __future__ import annotations

import gc
import hashlib
import sys
import time
from pathlib import Path

from eng_ranks import _export, _save, main

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: engine_states

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 300):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="Megatron VLM scenario")


def _engine(args, **changes):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options

    opts = dict(model_path=args["model"], optim=OptimConfig(**args["optim"]), micro_batch_size=1,
                total_steps=4, use_distributed_optimizer=True)
    return MegatronEngine(default_options(**{**opts, **changes}))


def _update(eng, args, batch):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.megatron import Actor

    cfg = ActorConfig(**args["actor"])
    return Actor(eng, cfg).update(batch, PolicyObjective.from_config(cfg))


def _tower_digest(eng) -> str:
    """sha1 of this rank's own tower parameters ("" on a stage without the tower)."""
    visual = getattr(eng.gpt_chunks[0], "visual", None)
    if visual is None:
        return ""
    h = hashlib.sha1()
    for p in visual.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_layout(args, layout, workdir, batch) -> dict:
    res = {}
    eng = _engine(args, trainable=False)
    _save(workdir, f"{layout}.forward", eng.forward(batch, outputs=("log_probs",)))
    del eng
    for tower, changes in (("frozen", {}), ("trained", {"train_vision_tower": True})):
        eng = _engine(args, **changes)
        res[tower] = _update(eng, args, batch)
        _save(workdir, f"{layout}.{tower}", _export(eng))
        if tower == "trained":
            res["tower_digest"] = _tower_digest(eng)
        del eng
        gc.collect()
    return res


def chain(args, workdir, batch, out) -> None:
    """The checkpoint chain of the module docstring (engine_states builds, updates, saves, loads)."""
    import torch.distributed as dist

    from engine_states import engine, load, save, update, weights
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    ck = {k: Path(workdir) / "ckpt" / k for k in ("M1", "F0", "F1", "M2")}
    meta, lr = out.setdefault("meta", {}), out.setdefault("lr", {})
    model = args["model"]
    init_model_parallel(2, 1, seed=1)
    eng = engine("megatron", model)
    lr["megatron_tp2.1"] = update(eng, batch)["actor/lr"]
    meta["M1"] = save(eng, ck["M1"], 1, {"tp": 2, "pp": 1})
    update(eng, batch)
    _save(workdir, "chain.megatron_tp2.step2", weights(eng))
    del eng
    destroy_model_parallel()
    gc.collect()
    dist.barrier()
    eng = engine("fsdp", model)
    load(eng, ck["M1"] / "step_000001")
    meta["F0"] = save(eng, ck["F0"], 1, {"fsdp": 4})
    lr["fsdp.2"] = update(eng, batch)["actor/lr"]
    _save(workdir, "chain.fsdp.step2", weights(eng))
    meta["F1"] = save(eng, ck["F1"], 2, {"fsdp": 4})
    update(eng, batch)
    _save(workdir, "chain.fsdp.step3", weights(eng))
    del eng
    gc.collect()
    dist.barrier()
    init_model_parallel(2, 2, seed=1)
    eng = engine("megatron", model)
    load(eng, ck["F1"] / "step_000002")
    meta["M2"] = save(eng, ck["M2"], 2, {"tp": 2, "pp": 2})
    lr["megatron_tp2pp2.3"] = update(eng, batch)["actor/lr"]
    _save(workdir, "chain.megatron_tp2pp2.step3", weights(eng))
    del eng
    destroy_model_parallel()
    gc.collect()


def scenario(args, workdir, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    batch = torch.load(Path(workdir) / "batch.pt", weights_only=False)
    for layout, (tp, pp) in LAYOUTS.items():
        print(f"layout {layout}", flush=True)  # the rank's log says where a hang was
        t = time.time()
        init_model_parallel(tp, pp, seed=1)
        out["layouts"][layout] = {"checks": check_layout(args, layout, workdir, batch), "tp": tp, "pp": pp}
        destroy_model_parallel()
        gc.collect()
        dist.barrier()
        out["seconds"][layout] = time.time() - t
    t = time.time()
    chain(args, workdir, batch, out)
    out["seconds"]["chain"] = time.time() - t


if __name__ == "__main__":
    main(sys.argv[1], scenario)
