"""Rank side of test_eng_memory.py: what each role really holds, per layout, for the memory plan.

One process set runs every layout of args["layouts"] (init model parallel, build, measure, tear
down). Per layout and rank it records:
- the bytes of every distinct storage behind the actor's parameters, main grads and optimizer
  states after one update (Adam's moments exist from the first step), and the reference's weights;
- the bytes autograd saves for backward during one real forward of each decoder chunk in training
  mode (torch.autograd.graph.saved_tensors_hooks, distinct storages, parameters excluded);
- with the layout's `offload` flag: the actor's and reference's resident bytes while idle, and
  the exported weights after 3 RL-like steps (old log-probs, ref log-probs, update, export) with
  offload on and off, saved for a bitwise comparison.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 500):
    from rank_launcher import launch_ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="memory layouts")


def _options(args, layout, **kw):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import default_options

    o = dict(model_path=args["model"], optim=OptimConfig(**args["optim"]), micro_batch_size=2,
             total_steps=10, use_distributed_optimizer=True,
             recompute_granularity=layout.get("recompute", "none"),
             recompute_method=layout.get("method", "uniform"),
             recompute_num_layers=layout.get("num_layers", 1))
    o.update(kw)
    return default_options(**o)


def _loss(out, mb, counts):
    lp = out["log_probs"]
    mask = mb["response_mask"]
    return -(lp * mb["advantages"] * mask).sum() / counts.tokens, {}


def storage_bytes(tensors, exclude=()) -> int:
    import torch

    seen, total = set(exclude), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def walk(engine) -> dict:
    from verl_hpc.engines.offload import engine_tensors

    t = engine_tensors(engine)
    params = {p.untyped_storage().data_ptr() for p in t["params"]}
    grads = {g.untyped_storage().data_ptr() for g in t["grads"] if g is not None}
    return {"weights": storage_bytes(t["params"]), "grads": storage_bytes(t["grads"], params),
            "optimizer": storage_bytes(t["optimizer"], params | grads)}


def saved_activation_bytes(engine, s: int, b: int) -> int:
    """Bytes autograd keeps for backward over the decoder layers of this rank's chunks."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in engine._parameters()}
    seen, total = set(params), [0]

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total[0] += st.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (b, s), generator=g)
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    h = engine.gpt_chunks[0].config.hidden_size
    outs = []
    for gpt in engine.gpt_chunks:
        gpt.train()
        decoder_forward = gpt.decoder.forward

        def hooked(*a, _f=decoder_forward, **k):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return _f(*a, **k)

        gpt.decoder.forward = hooked
        try:
            if not gpt.pre_process:
                gpt.set_input_tensor(torch.randn(s, b, h, requires_grad=True))
            outs.append(gpt(ids, pos, None))
        finally:
            del gpt.decoder.forward
    del outs
    return total[0]


def rl_steps(args, layout, batch, offload: bool) -> dict:
    """3 steps of old log-probs, ref log-probs, actor update, export; returns the last export and
    the idle roles' resident bytes after each step."""
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.megatron import Actor, MegatronEngine

    flags = dict(param_offload=offload, grad_offload=offload, optimizer_offload=offload)
    acfg = ActorConfig(ppo_mini_batch_size=4, use_kl_loss=True, kl_loss_coef=0.1)
    actor = Actor(MegatronEngine(_options(args, layout, **flags)), acfg)
    objective = PolicyObjective.from_config(acfg)
    ref = MegatronEngine(_options(args, layout, trainable=False, param_offload=offload))
    idle, export = [], None
    for _ in range(3):
        t = dict(batch)
        t.update(actor.log_probs(t))
        t["ref_log_probs"] = ref.forward(t, ("log_probs",))["log_probs"]
        actor.update(t, objective)
        export = {n: w.clone() for n, w in actor.engine.export_hf_weights()}
        idle.append({"actor": actor.engine.offloader.device_bytes(),
                     "ref": ref.offloader.device_bytes()})
    full = walk(actor.engine)  # its states while resident, for the plan's figures
    with actor.engine.resident("train"):
        resident = walk(actor.engine)
    return {"export": export, "idle": idle, "walk_idle": full, "walk_resident": resident}


def run_layout(args, layout, workdir) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    t0 = time.time()
    mp = init_model_parallel(layout["tp"], layout["pp"], vpp=layout.get("vpp"), seed=1)
    batch = torch.load(Path(workdir) / "batch.pt")
    out = {"dp": mp.dp, "tp_rank": mp.tp_rank, "pp_rank": mp.pp_rank}
    actor = MegatronEngine(_options(args, layout))
    actor.train_step(batch, _loss)
    out["actor"] = walk(actor)
    s, b = args["act_seq"], args["act_batch"]
    out["activations"] = saved_activation_bytes(actor, s, b)
    del actor
    gc.collect()
    ref = MegatronEngine(_options(args, layout, trainable=False))
    out["ref"] = walk(ref)
    del ref
    gc.collect()
    if layout.get("offload"):
        res = {name: rl_steps(args, layout, batch, flag) for name, flag in (("off", False), ("on", True))}
        if torch.distributed.get_rank() == 0:
            torch.save({k: v["export"] for k, v in res.items()},
                       Path(workdir) / f"{layout['name']}.exports.pt")
        out["offload"] = {k: {kk: vv for kk, vv in v.items() if kk != "export"} for k, v in res.items()}
    destroy_model_parallel()
    out["seconds"] = time.time() - t0
    assert ps is not None
    return out


def main(workdir: str) -> None:
    import torch.distributed as dist

    from verl_hpc.runtime import bootstrap

    args = json.loads((Path(workdir) / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=180)
    out = {"rank": ctx.rank, "layouts": {}}
    for layout in args["layouts"]:
        print(f"layout {layout['name']}", flush=True)
        out["layouts"][layout["name"]] = run_layout(args, layout, workdir)
        dist.barrier()
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
