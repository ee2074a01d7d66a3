"""Rank side of test_eng_fsdp_memory.py: what the FSDP engine really holds, per layout, for the plan.

One process set runs every layout of args["layouts"] (the `fsdp:` section's fields it varies).
Per layout and rank it records:
- the bytes of every distinct storage behind the actor's local weight shards, its gradients
  (after the backward below) and Adam's moments, and the gradient shards an update leaves;
  the reference's (frozen) weight shards;
- the bytes alive at the end of one training-mode forward of a micro-batch, made by the decoder
  layers (what they keep for backward; a TorchDispatchMode notes every storage an op makes inside
  a layer, FSDP's gathered weights excluded) and made outside them;
- the gathered bytes in flight, at their peak over that micro-batch's forward and over its whole
  forward + backward: FSDP2's unsharded weights (every unit's all-gather outputs), the all-gather
  buffers pending or kept for the next copy-out, the unsharded gradients (on the parameters, then
  in the list FSDP2 hands its reduce-scatter), and each reduce-scatter input when it is allocated
  (hooks on FSDP2's param-group methods and collectives; read-only);
- with the layout's `offload` flag, an actor offloading its weights, gradients and Adam states: the
  bytes it keeps on the device while idle after an update, and while resident for one.
"""
from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from pathlib import Path


def launch(world_size: int, args: dict, workdir: Path, timeout: float = 300):
    from rank_launcher import launch_ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="FSDP memory layouts")


def _options(args, layout, **kw):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.config.sections.fsdp import FsdpConfig
    from verl_hpc.engines.options import default_options

    fsdp = FsdpConfig(**layout.get("fsdp", {}))
    o = dict(model_path=args["model"], engine="fsdp", fsdp=fsdp, optim=OptimConfig(**args["optim"]),
             micro_batch_size=args["act_batch"], total_steps=10)
    o.update(kw)
    return default_options(**o)


def _loss(out, mb, counts):
    return -(out["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / counts.tokens, {}


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


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def states(engine) -> dict:
    m = engine.model
    params = [_local(p) for p in m.parameters()]
    grads = [_local(p.grad) for p in m.parameters() if p.grad is not None]
    opt = [_local(v) for st in (engine.optimizer.state.values() if engine.optimizer else ())
           for v in st.values() if hasattr(v, "dim") and v.dim() > 0]
    return {"weights": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(opt)}


def fsdp_groups(model):
    out = []
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is not None:
            out += [g for g in get()._fsdp_param_groups if g not in out]
    return out


class Gathered:
    """Peak bytes of what FSDP2 holds unsharded (module docstring), sampled at every change."""

    def __init__(self, model):
        self.groups = fsdp_groups(model)
        self.peak = 0
        self.reducing: list = []  # the unsharded grads FSDP2 hands to its reduce-scatter

    def now(self, extra: int = 0) -> int:
        tensors = []
        for g in self.groups:
            for fp in g.fsdp_params:
                tensors += list(fp.all_gather_outputs)
                up = getattr(fp, "_unsharded_param", None)
                if up is not None and up.grad is not None:
                    tensors.append(up.grad)
            if g._all_gather_result is not None:
                tensors.append(g._all_gather_result.all_gather_output)
            state = g.comm_ctx.all_gather_state
            if state is not None:
                tensors.append(state.all_gather_result.all_gather_output)
        total = storage_bytes(tensors + self.reducing) + extra
        self.peak = max(self.peak, total)
        return total

    @contextlib.contextmanager
    def watching(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        names = ("unshard", "wait_for_unshard", "reshard", "pre_backward", "post_backward")
        saved = {n: getattr(FSDPParamGroup, n) for n in names}
        alloc = coll.DefaultReduceScatter.allocate

        def wrap(fn):
            def hooked(group, *a, **k):
                self.now()
                out = fn(group, *a, **k)
                self.now()
                return out
            return hooked

        def allocate(comm, *a, **k):  # the reduce-scatter input, on top of what is gathered now
            t = alloc(comm, *a, **k)
            self.now(t.untyped_storage().nbytes())
            return t

        reduce = pg.foreach_reduce

        def foreach_reduce(fsdp_params, unsharded_grads, *a, **k):  # the list owns the grads
            self.reducing = unsharded_grads
            try:
                return reduce(fsdp_params, unsharded_grads, *a, **k)
            finally:
                self.reducing = []

        for n, fn in saved.items():
            setattr(FSDPParamGroup, n, wrap(fn))
        coll.DefaultReduceScatter.allocate, pg.foreach_reduce = allocate, foreach_reduce
        try:
            yield self
        finally:
            for n, fn in saved.items():
                setattr(FSDPParamGroup, n, fn)
            coll.DefaultReduceScatter.allocate, pg.foreach_reduce = alloc, reduce


def made_by_layers(engine, mb) -> dict:
    """Bytes alive after a training forward of `mb`, made inside the decoder layers / outside."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Made(TorchDispatchMode):
        where = "outside"
        made: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.made.append((self.where, StorageWeakRef(t.untyped_storage())))
            return out

    model, mode = engine.model, Made()
    layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    # FSDP's own hooks run before ours on entry and after ours on exit: its gathers are outside
    hooks = [h for u in layers for h in (u.register_forward_pre_hook(lambda *a: setattr(mode, "where", "layers")),
                                        u.register_forward_hook(lambda *a: setattr(mode, "where", "outside")))]
    model.train()
    with Gathered(model).watching() as gathered:
        with mode:
            out = engine._run(mb, ("log_probs",))
        forward_peak = gathered.peak
        exclude = {t.untyped_storage().data_ptr() for g in fsdp_groups(model) for fp in g.fsdp_params
                   for t in fp.all_gather_outputs}
        exclude |= {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        alive, seen = {"layers": 0, "outside": 0}, set(exclude)
        for where, ref in mode.made:
            if ref.expired():
                continue
            st = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                alive[where] += st.nbytes()
        loss = -(out["log_probs"] * mb.data["response_mask"]).sum()
        del out
        loss.backward()
    for h in hooks:
        h.remove()
    return {**alive, "gathered_forward": forward_peak, "gathered_step": gathered.peak}


def run_layout(args, layout, workdir) -> dict:
    import torch

    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.fsdp.microbatch import MicroBatch

    batch = torch.load(Path(workdir) / "batch.pt")
    act = torch.load(Path(workdir) / "act_batch.pt")
    t0 = time.time()
    actor = FsdpEngine(_options(args, layout))
    actor.train_step(batch, _loss)  # Adam's moments exist from the first step
    out = {"grads_after_update": states(actor)["grads"]}
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = list(range(rank * args["act_batch"], (rank + 1) * args["act_batch"]))
    out.update(made_by_layers(actor, MicroBatch(act, rows, actor.device)))
    out["actor"] = states(actor)  # the sharded grads of that backward are there until zeroed
    actor.optimizer.zero_grad(set_to_none=True)
    del actor
    gc.collect()
    ref = FsdpEngine(_options(args, layout, trainable=False))
    out["ref"] = states(ref)
    del ref
    gc.collect()
    if layout.get("offload"):  # <role>.param_offload / optimizer_offload: what an idle actor keeps
        actor = FsdpEngine(_options(args, layout, param_offload=True, grad_offload=True, optimizer_offload=True))
        actor.train_step(batch, _loss)
        out["offloaded_idle"] = actor.offloader.device_bytes()
        with actor.resident("train"):
            out["offloaded_resident"] = actor.offloader.device_bytes()
        del actor
        gc.collect()
    assert world == args["world"]
    out["seconds"] = time.time() - t0
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
