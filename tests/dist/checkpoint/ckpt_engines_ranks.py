"""Rank side of test_ckpt_cross_engine.py: one checkpoint carried across the two engines and three
layouts on the same 2 gloo ranks, one phase after the other:

    megatron_tp2  Megatron TP2: update 1 -> save M1; update 2 -> weights (the run as it would go on)
    fsdp          FSDP over 2 ranks: load M1 -> save F0 at once; update 2 -> weights; save F1;
                  update 3 -> weights. A fresh engine loads S1 (written by one rank before the
                  launch) -> saves S1r at once.
    megatron_pp2  Megatron PP2: load F1 -> save M2 at once; update 3 -> weights

Rank 0 writes the HF-named weights after each update as `<phase>.step<k>.pt`; every rank writes
rank{r}.json with the engines' meta and the LR each update used.

    python ckpt_engines_ranks.py WORKDIR     (started by tests/rank_launcher.py)

The helpers above `main` are this scenario's and the test's (which runs the one-rank side).
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

ROLE = "actor"


def make_batch(seed: int, n: int = 8):
    """n random prompt/response pairs with seeded advantages and behaviour log-probs (old_log_probs
    near the tiny model's: log(1 / 500) ~ -6.2), the keys PolicyObjective reads."""
    import torch

    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(seed)
    plen, rlen = torch.randint(2, 9, (n,), generator=g), torch.randint(1, 11, (n,), generator=g)
    prompts = [torch.randint(5, 480, (int(p),), generator=g).tolist() for p in plen]
    resps = [torch.randint(5, 480, (int(r),), generator=g).tolist() for r in rlen]
    batch = pack_sequences(prompts, resps)
    mask = get_response_mask(batch)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = (-6.2 + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    return batch


def actor_cfg():
    from verl_hpc.config.schema import ActorConfig

    return ActorConfig(ppo_mini_batch_size=8, micro_batch_size=4)


def optim_cfg():
    """Adam with eps 1 (the first steps SGD-like: weights then compare gradients, not the sign of
    rounding noise) and a linear LR decay, so a resumed schedule or step count that is off shows."""
    from verl_hpc.config.schema import OptimConfig

    return OptimConfig(lr=0.5, eps=1.0, clip_grad=1.0, weight_decay=0.0, lr_decay_style="linear", min_lr=0.1)


def engine(kind: str, model: str):
    from verl_hpc.engines.options import default_options

    opts = default_options(model_path=model, engine=kind, optim=optim_cfg(), micro_batch_size=4,
                           total_steps=10, use_distributed_optimizer=True)
    if kind == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return FsdpEngine(opts)
    from verl_hpc.engines.megatron import MegatronEngine

    return MegatronEngine(opts)


def update(eng, batch) -> dict:
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.roles import Actor

    acfg = actor_cfg()
    return Actor(eng, acfg).update(batch, PolicyObjective.from_config(acfg))


def weights(eng) -> dict:
    """{HF name: full tensor} (collective: every rank calls it)."""
    return {n: t.detach().clone() for n, t in eng.export_hf_weights()}


def save(eng, root, step: int, layout: dict) -> dict:
    """The engine's state as the trainer's checkpointer writes it (under `actor/`); its meta."""
    from verl_hpc.checkpoint import save_checkpoint
    from verl_hpc.checkpoint.checkpointer import _prefixed

    st = eng.state()
    save_checkpoint(root, step, _prefixed(ROLE, st.tensors),
                    metadata={"trainer_state": {"engines": {ROLE: st.meta}}}, layout=layout)
    return st.meta


def load(eng, path) -> dict:
    """Resume `eng` from the checkpoint at `path` as the checkpointer does; the meta it read."""
    from verl_hpc.checkpoint import open_checkpoint
    from verl_hpc.checkpoint.checkpointer import RoleLoader

    with open_checkpoint(path) as r:
        meta = r.metadata["trainer_state"]["engines"][ROLE]
        eng.load_state(RoleLoader(r, ROLE), meta)
    return meta


def main(workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel
    from verl_hpc.runtime import bootstrap

    work = Path(workdir)
    args = json.loads((work / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=180)
    model, ck = args["model"], {k: Path(v) for k, v in args["ckpt"].items()}
    batches = [make_batch(s) for s in args["batch_seeds"]]
    rec: dict = {"rank": ctx.rank, "meta": {}, "lr": {}}

    def keep(name, w):
        if ctx.rank == 0:
            torch.save(w, work / f"{name}.pt")

    # --- Megatron TP2
    init_model_parallel(2, 1, seed=1)
    eng = engine("megatron", model)
    rec["lr"]["megatron_tp2.1"] = update(eng, batches[0])["actor/lr"]
    rec["meta"]["M1"] = save(eng, ck["M1"], 1, {"tp": 2, "pp": 1})
    rec["lr"]["megatron_tp2.2"] = update(eng, batches[1])["actor/lr"]
    keep("megatron_tp2.step2", weights(eng))
    del eng
    destroy_model_parallel()
    gc.collect()
    dist.barrier()

    # --- FSDP on the same 2 ranks (no Megatron parallel state)
    eng = engine("fsdp", model)
    load(eng, ck["M1"] / "step_000001")
    rec["lr"]["fsdp.loaded"] = eng.lr
    rec["meta"]["F0"] = save(eng, ck["F0"], 1, {"fsdp": 2})
    rec["lr"]["fsdp.2"] = update(eng, batches[1])["actor/lr"]
    keep("fsdp.step2", weights(eng))
    rec["meta"]["F1"] = save(eng, ck["F1"], 2, {"fsdp": 2})
    rec["lr"]["fsdp.3"] = update(eng, batches[2])["actor/lr"]
    keep("fsdp.step3", weights(eng))
    del eng
    eng = engine("fsdp", model)  # a checkpoint one rank wrote, at 2 ranks
    load(eng, ck["S1"])
    rec["meta"]["S1r"] = save(eng, ck["S1r"], 1, {"fsdp": 2})
    del eng
    gc.collect()
    dist.barrier()

    # --- Megatron PP2
    init_model_parallel(1, 2, seed=1)
    eng = engine("megatron", model)
    load(eng, ck["F1"] / "step_000002")
    rec["lr"]["megatron_pp2.loaded"] = eng.lr
    rec["meta"]["M2"] = save(eng, ck["M2"], 2, {"tp": 1, "pp": 2})
    rec["lr"]["megatron_pp2.3"] = update(eng, batches[2])["actor/lr"]
    keep("megatron_pp2.step3", weights(eng))
    del eng
    destroy_model_parallel()
    (work / f"rank{ctx.rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
