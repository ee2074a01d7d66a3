"""Spawn gloo ranks that run the engine scenario under the project's runtime, and the scenario.

`launch(n, args, workdir)` starts n copies of this file with torchrun-style variables, so
`verl_hpc.runtime.bootstrap()` brings each rank up as in a real job. The scenario is `scenario()`
below, plain code read top to bottom: one process set runs every layout in turn (init model
parallel, run the layout's checks, tear down), since spawning ranks and importing Megatron costs
far more than the checks. Each rank writes `rank{r}.json`; tensors the test compares (exports,
forward outputs) are saved by global rank 0 as `<layout>.<check>.<model>.pt`. `args` (args.json)
carries only the test's inputs: model folders, optimizer and actor settings, sizes.
"""
from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODELS = ("llama", "qwen2_tied")  # the actor models (test_eng_parity.MODELS builds them)
# (layout, model) of every actor check, in the scenario's order: the test parametrizes over them
ACTOR_LAYOUTS = ([(lay, m) for lay in ("tp1", "tp2", "pp2") for m in MODELS] + [("pp2vpp2", "llama")]
                 + [("tp2pp2", m) for m in MODELS])


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 400):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="engine scenario")


# ----------------------------------------------------------------------------- rank side


def _optim(spec: dict):
    from verl_hpc.config.schema import OptimConfig

    return OptimConfig(**spec)


def _actor_cfg(spec: dict):
    from verl_hpc.config.schema import ActorConfig

    return ActorConfig(**spec)


def _update(eng, acfg, batch):
    """One Actor.update with the policy objective of `acfg` (what the trainer passes)."""
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.megatron import Actor

    return Actor(eng, acfg).update(batch, PolicyObjective.from_config(acfg))


def _engine(args, model: str, **kw):
    from verl_hpc.engines.megatron import default_options, MegatronEngine

    opts = dict(model_path=args["models"][model], optim=_optim(args["optim"]),
                micro_batch_size=args["micro_batch_size"], total_steps=args["total_steps"],
                use_distributed_optimizer=True)
    opts.update(kw)
    return MegatronEngine(default_options(**opts))


def _save(workdir, name, obj):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(obj, Path(workdir) / f"{name}.pt")


def _export(engine) -> dict:
    return {n: t.clone() for n, t in engine.export_hf_weights()}


def _full_logits(engine, ids):
    """Full-vocabulary logits of the engine's model through Megatron's schedule (None off the
    last stage), one sequence per micro-batch; broadcast so every rank returns them."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from verl_hpc.models.gpt import full_vocab_logits

    arch = engine.gpt_chunks[0].verl_arch
    captured = []
    pos = torch.arange(ids.shape[1]).unsqueeze(0)

    def step(it, m):
        def loss(o):
            captured.append(full_vocab_logits(o, arch).detach())
            return o.new_zeros(()), {}
        return m(next(it), pos, None), loss

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([ids[i:i + 1] for i in range(len(ids))]),
                                    model=engine.chunks, num_microbatches=len(ids),
                                    seq_length=ids.shape[1], micro_batch_size=1, forward_only=True)
    out = torch.cat(captured) if captured else torch.zeros(len(ids), ids.shape[1], arch.vocab_size)
    group = ps.get_pipeline_model_parallel_group()
    dist.broadcast(out, src=dist.get_global_rank(group, group.size() - 1), group=group)
    return out


def check_actor(args, layout, workdir, model, batch, *, logits: bool = False) -> dict:
    """Forward outputs; one actor update with fixed micro-batches, one with dynamic batching;
    with `logits`, the full-vocabulary logits after the update too. llama's batch shares prompts:
    its engines pack them wherever the layout allows (share_prompts=on: the tiny model's cost
    model alone would not pack 8-token prompts)."""
    res = {}
    acfg = _actor_cfg(args["actor"][model])
    share = {"share_prompts": "on"} if model == "llama" and layout != "pp2vpp2" else {}
    eng = _engine(args, model, **share)  # use_distributed_optimizer=True
    res["optimizers"] = [type(o).__name__ for o in getattr(eng.optimizer, "chained_optimizers", [eng.optimizer])]
    fwd = eng.forward(batch)
    _save(workdir, f"{layout}.forward.{model}", fwd)
    metrics = _update(eng, acfg, batch)
    res["fixed"] = metrics
    _save(workdir, f"{layout}.fixed.{model}", _export(eng))
    if logits:
        _save(workdir, f"{layout}.logits.{model}", _full_logits(eng, batch["input_ids"]))
    del eng
    gc.collect()
    eng = _engine(args, model, max_tokens_per_microbatch=args["max_tokens"], **share)
    res["dynamic"] = _update(eng, acfg, batch)
    _save(workdir, f"{layout}.dynamic.{model}", _export(eng))
    return res


def check_roles(args, layout, workdir, batch) -> dict:
    """Critic values + update, reference (frozen), reward model scores."""
    import torch

    from verl_hpc.algorithms import ValueObjective
    from verl_hpc.config.schema import CriticConfig
    from verl_hpc.engines.megatron import Critic, default_options, MegatronEngine, Reference, RewardModel

    res = {}
    critic = Critic(_engine(args, "llama", head="value"), CriticConfig(ppo_mini_batch_size=8))
    values = critic.values(batch)["values"]
    cb = dict(batch, values=values, returns=values + torch.linspace(-1, 1, values.numel()).view_as(values))
    res["critic_update"] = critic.update(cb, ValueObjective.from_config(critic.cfg))
    values_after = critic.values(batch)["values"]
    _save(workdir, f"{layout}.critic.llama", {"before": values, "after": values_after})
    res["critic_export_names"] = [n for n, _ in critic.engine.export_hf_weights()][-2:]
    del critic
    ref = Reference(MegatronEngine(default_options(model_path=args["models"]["llama"], trainable=False,
                                                   micro_batch_size=3)))
    res["ref_requires_grad"] = any(p.requires_grad for p in ref.engine._parameters())
    res["ref_optimizer"] = ref.engine.optimizer is not None
    res["ref_grads"] = any(p.grad is not None for p in ref.engine._parameters())
    try:
        ref.engine.train_step(batch, lambda *a: None)
        res["ref_train_error"] = ""
    except RuntimeError as e:
        res["ref_train_error"] = str(e)
    _save(workdir, f"{layout}.ref.llama", ref.log_probs(batch))
    del ref
    rm = RewardModel(MegatronEngine(default_options(model_path=args["models"]["reward"], head="value",
                                                    trainable=False, max_tokens_per_microbatch=30)))
    _save(workdir, f"{layout}.reward.reward", rm.score(batch))
    del rm
    local = MegatronEngine(default_options(model_path=args["models"]["llama"], trainable=False,
                                           sdpa_attention=False))
    _save(workdir, f"{layout}.local_attention.llama", local.forward(batch))
    return res


PRM_LAYOUTS = ("tp1", "tp2", "pp2")  # PRIME's implicit PRM: forward and one CE update (check_prm)
PRM_BETA = 0.5


def check_prm(args, layout, workdir, batch) -> dict:
    """The implicit PRM role (an lm engine, packed prompts): its log-probs, then one update of the
    CE objective against fixed labels and the batch's ref_log_probs; the weights after it."""
    import torch

    from verl_hpc.algorithms import PrmObjective
    from verl_hpc.engines.megatron import ProcessRewardModel

    role_cfg = type("PrmSection", (), {"ppo_mini_batch_size": 8, "ppo_epochs": 1})
    prm = ProcessRewardModel(_engine(args, "llama", share_prompts="on"), role_cfg)
    _save(workdir, f"{layout}.prm_forward.llama", prm.log_probs(batch))
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    res = prm.update(dict(batch, outcome_labels=labels), PrmObjective(beta=PRM_BETA, loss="ce"))
    _save(workdir, f"{layout}.prm_update.llama", _export(prm.engine))
    return res


def check_nonfinite(args, layout, workdir, batch) -> dict:
    import torch

    eng = _engine(args, "llama")
    before = _export(eng)
    bad = dict(batch, advantages=batch["advantages"].clone())
    bad["advantages"][1, 0] = float("nan")
    metrics = _update(eng, _actor_cfg(args["actor"]["llama"]), bad)
    after = _export(eng)
    same = all(torch.equal(before[n], after[n]) for n in before)
    good = _update(eng, _actor_cfg(args["actor"]["llama"]), batch)  # still trains afterwards
    return {"metrics": metrics, "unchanged": same, "then": good}


def check_zero_adv(args, layout, workdir, batch) -> dict:
    """actor.skip_zero_advantage_rows across data-parallel ranks: an update where 3 of 8 rows have
    advantages (so a rank gets none), then one where no row has (one row runs, the other ranks
    run empty micro-batches); the weights against the same updates without the skip."""
    import dataclasses

    import torch

    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.megatron import Actor

    first = dict(batch, advantages=batch["advantages"].clone())
    first["advantages"][[0, 1, 2, 6, 7]] = 0.0
    second = dict(batch, advantages=torch.zeros_like(batch["advantages"]))
    # no KL or entropy term: they would forbid the skip; no clipping, which hides a scale error
    acfg = _actor_cfg(dict(args["actor"]["llama"], entropy_coeff=0.0, use_kl_loss=False))
    out = {}
    for skip in (False, True):
        eng = _engine(args, "llama", optim=_optim(dict(args["optim"], clip_grad=0.0)))
        cfg = dataclasses.replace(acfg, skip_zero_advantage_rows=skip)
        actor, loss = Actor(eng, cfg), PolicyObjective.from_config(cfg)
        m1, w1 = actor.update(first, loss), _export(eng)
        m2, w2 = actor.update(second, loss), _export(eng)
        out[skip] = {"metrics": [m1, m2], "weights": w2,
                     "moved_by_second": max(float((w2[n] - w1[n]).abs().max()) for n in w1)}
    diff = max(float((out[True]["weights"][n] - out[False]["weights"][n]).abs().max()) for n in out[True]["weights"])
    return {"max_diff": diff, "moved_by_second": out[False]["moved_by_second"],
            "skip": out[True]["metrics"], "full": out[False]["metrics"]}


def _write_state(workdir, tag, state):
    import torch
    import torch.distributed as dist

    slabs = [(t.name, t.local.clone(), tuple(t.global_shape), tuple(t.offsets)) for t in state.tensors]
    torch.save({"slabs": slabs, "meta": state.meta}, Path(workdir) / f"{tag}.state{dist.get_rank()}.pt")


def _read_state(workdir, tag):
    """Every writer's slabs assembled into global tensors (a stand-in for the HDF5 layer)."""
    import torch

    tensors, meta = {}, None
    for f in sorted(Path(workdir).glob(f"{tag}.state*.pt")):
        d = torch.load(f)
        meta = d["meta"]
        for name, local, gshape, offs in d["slabs"]:
            full = tensors.setdefault(name, torch.full(gshape, float("nan"), dtype=local.dtype))
            full[tuple(slice(o, o + n) for o, n in zip(offs, local.shape))] = local
    return tensors, meta


def check_state_save(args, layout, workdir, batch, batch2) -> dict:
    eng = _engine(args, "llama", optim=_optim(args["state_optim"]))
    acfg = _actor_cfg(args["actor"]["llama"])
    m1 = _update(eng, acfg, batch)
    st = eng.state()
    _write_state(workdir, layout, st)
    names = sorted({t.name for t in st.tensors})
    m2 = _update(eng, acfg, batch2)
    _save(workdir, f"{layout}.continued.llama", _export(eng))
    return {"names": names, "meta": st.meta, "step1": m1, "step2": m2}


def check_state_load(args, layout, workdir, batch2, *, saved_at: str) -> dict:
    import math

    tensors, meta = _read_state(workdir, saved_at)
    # saved with the distributed optimizer, loaded into the plain one: the slabs do not care
    eng = _engine(args, "llama", optim=_optim(args["state_optim"]), use_distributed_optimizer=False)
    nan_targets = []

    def load_into(targets):
        for t in targets:
            src = tensors[t.name][tuple(slice(o, o + n) for o, n in zip(t.offsets, t.local.shape))]
            if bool(src.isnan().any()):
                nan_targets.append(t.name)
            t.local.copy_(src)

    eng.load_state(load_into, meta)
    lr_loaded = eng.lr
    names = sorted({t.name for t in eng.state().tensors})
    m2 = _update(eng, _actor_cfg(args["actor"]["llama"]), batch2)
    _save(workdir, f"{layout}.resumed.llama", _export(eng))
    return {"names": names, "lr_loaded": lr_loaded, "step2": m2, "nan_targets": nan_targets,
            "all_finite": all(math.isfinite(v) for v in m2.values())}


@contextlib.contextmanager
def megatron_layout(out: dict, name: str, tp: int, pp: int, vpp=None):
    """Megatron model parallelism at tp x pp (x vpp) over every rank (data parallel fills the rest)
    for the block; yields the layout's record (`checks`, `seconds`) and tears down after it."""
    import torch.distributed as dist

    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    t0 = time.time()
    mp = init_model_parallel(tp, pp, vpp=vpp, seed=1)
    rec = out["layouts"][name] = {"name": name, "dp": mp.dp, "tp_rank": mp.tp_rank, "pp_rank": mp.pp_rank,
                                  "checks": {}, "seconds": {}}
    yield rec
    destroy_model_parallel()
    rec["seconds"]["layout"] = time.time() - t0
    dist.barrier()


def run_check(rec: dict, key: str, fn, *args, **kw) -> None:
    """rec["checks"][key] = fn(*args, **kw), timed; the name goes to the rank's log first (where a
    hang was)."""
    print(f"layout {rec['name']}: {key}", flush=True)
    t = time.time()
    rec["checks"][key] = fn(*args, **kw)
    rec["seconds"][key] = time.time() - t
    gc.collect()


def actor_checks(args, rec: dict, workdir, data, *, logits_of: str = "") -> None:
    """check_actor for every model ACTOR_LAYOUTS pairs with this layout."""
    lay = rec["name"]
    for model in [m for name, m in ACTOR_LAYOUTS if name == lay]:
        run_check(rec, f"actor.{model}", check_actor, args, lay, workdir, model, data[f"batch.{model}"],
                  logits=model == logits_of)


def scenario(args, workdir, out: dict) -> None:
    """The table of tests/dist/engines/test_eng_parity.py's docstring, in its order."""
    import torch

    data = torch.load(Path(workdir) / "batch.pt")
    llama, llama2 = data["batch.llama"], data["batch2.llama"]
    with megatron_layout(out, "tp1", tp=1, pp=1) as rec:
        actor_checks(args, rec, workdir, data)
        run_check(rec, "prm", check_prm, args, "tp1", workdir, llama)
        run_check(rec, "roles", check_roles, args, "tp1", workdir, llama)
        run_check(rec, "nonfinite", check_nonfinite, args, "tp1", workdir, llama)
        run_check(rec, "zero_adv", check_zero_adv, args, "tp1", workdir, llama)
    with megatron_layout(out, "tp2", tp=2, pp=1) as rec:
        actor_checks(args, rec, workdir, data)
        run_check(rec, "prm", check_prm, args, "tp2", workdir, llama)
    with megatron_layout(out, "pp2", tp=1, pp=2) as rec:
        actor_checks(args, rec, workdir, data)
        run_check(rec, "prm", check_prm, args, "pp2", workdir, llama)
        run_check(rec, "zero_adv", check_zero_adv, args, "pp2", workdir, llama)
    with megatron_layout(out, "pp2vpp2", tp=1, pp=2, vpp=2) as rec:
        actor_checks(args, rec, workdir, data)  # llama only (ACTOR_LAYOUTS)
    with megatron_layout(out, "tp2pp2", tp=2, pp=2) as rec:
        actor_checks(args, rec, workdir, data, logits_of="llama")
        run_check(rec, "roles", check_roles, args, "tp2pp2", workdir, llama)
        run_check(rec, "state_save", check_state_save, args, "tp2pp2", workdir, llama, llama2)
    with megatron_layout(out, "tp1_resume", tp=1, pp=1) as rec:
        # written at tp2pp2 with the distributed optimizer, loaded into the plain one
        run_check(rec, "state_load", check_state_load, args, "tp1_resume", workdir, llama2, saved_at="tp2pp2")


def main(workdir: str, run=None) -> None:
    """One rank: bootstrap, `run(args, workdir, out)` (default: this file's scenario), rank{r}.json."""
    import torch.distributed as dist

    from verl_hpc.runtime import bootstrap

    t0 = time.time()
    args = json.loads((Path(workdir) / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=180)
    out = {"rank": ctx.rank, "layouts": {}, "seconds": {"bootstrap": time.time() - t0}}
    (run or scenario)(args, workdir, out)
    out["seconds"]["total"] = time.time() - t0
    (Path(workdir) / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
