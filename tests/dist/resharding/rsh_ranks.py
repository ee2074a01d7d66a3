"""Spawn gloo ranks that run the resharding scenario under the project's runtime.

`launch(n, args, workdir)` starts n copies of this file with torchrun-style variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), so `verl_hpc.runtime.bootstrap()` brings each rank up
as in a real job. Each rank writes rank{r}.json; global rank 0 saves the exported weights of each
layout as `<layout>.state.pt` for the test to build a transformers model from. A failing rank
fails the launch with every rank's log tail.

The scenario (args["steps"], in order; one process set for all, since spawning ranks and importing
Megatron and vLLM costs far more than the checks):
    {"rollout": tp}                 close the current vLLM engine (if any), build one at inference TP
    {"layout": name, "tp", "pp"}    (re)initialise Megatron at that layout, build the actor from the
                                    job config, run one Actor.update; export it for the test
    {"check": label, "bucket_mb"}   sync the actor into vLLM, greedy generate, recompute the
                                    rollout's log-probs with the actor (engine.forward)
    {"digests": [mb, mb]}           sync into a DigestSink at each bucket size (bitwise comparison)
    {"tied": mb}                    a Megatron model of args["tied_model"] (tied embeddings, not
                                    updated) at the current layout, synced into a DigestSink and
                                    into a vLLM engine built from args["tied_other"]
    {"memory": [mb, ...]}           sync into a NullSink inside HeapPeak (args["memory_model"])
    {"failure": rank}               a sink that raises on that rank: every rank must raise SyncError
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]



def launch(world_size: int, args: dict, workdir: Path, timeout: float = 300):
    from rank_launcher import launch_ranks  # tests/: on sys.path under pytest, not in the ranks

    return launch_ranks(__file__, world_size, args, workdir, timeout=timeout, what="resharding scenario")


def train_batch(seed: int = 5, n: int = 8, vocab: int = 480):
    """Random prompts and responses with advantages: the actor's update batch."""
    import torch

    from verl_hpc.engines.batch import pack_sequences

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    resps = [torch.randint(5, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    batch = pack_sequences(prompts, resps)
    t = int(batch["response_lengths"].max())
    batch["advantages"] = torch.randn(n, t, generator=g)
    return batch


# ----------------------------------------------------------------------------- rank side


def _job_config(args, tp: int, pp: int):
    from verl_hpc.config.schema import JobConfig, OptimConfig

    cfg = JobConfig()
    cfg.model.path = args["model"]
    cfg.parallel.tp, cfg.parallel.pp = tp, pp
    cfg.actor.optim = OptimConfig(lr=args["lr"], clip_grad=0.0)
    cfg.actor.ppo_mini_batch_size = 8
    cfg.actor.micro_batch_size = 4
    cfg.rollout.temperature = 1.0  # the actor scores log-softmax(logits / 1): vLLM's greedy logprobs
    cfg.rollout.max_tokens = args["max_new"]
    cfg.data.max_prompt_length = args["max_prompt"]
    cfg.resharding.bucket_mb = 1
    return cfg


class _State:
    rollout = None
    rollout_tp = 0
    actor = None
    layout = ""


def _step_rollout(st, args, ctx, tp):
    from verl_hpc.rollout import build_rollout

    if st.rollout is not None:
        st.rollout.close()
    cfg = _job_config(args, 1, 1)
    cfg.rollout.tp = tp
    st.rollout, st.rollout_tp = build_rollout(cfg, ctx, max_num_seqs=16), tp


def _step_layout(st, args, ctx, step, workdir, out):
    import torch
    import torch.distributed as dist

    from verl_hpc.engines import build_engine
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    st.actor = None
    destroy_model_parallel()
    init_model_parallel(step["tp"], step["pp"], seed=1)
    cfg = _job_config(args, step["tp"], step["pp"])
    actor = build_engine("actor", cfg, ctx)
    batch = train_batch()
    batch["old_log_probs"] = actor.log_probs(batch)["old_log_probs"]
    metrics = actor.update(batch)
    state = {n: t.clone() for n, t in actor.engine.export_hf_weights()}
    if dist.get_rank() == 0:
        torch.save(state, Path(workdir) / f"{step['layout']}.state.pt")
    st.actor, st.layout = actor, step["layout"]
    out["updates"][step["layout"]] = {k: metrics[k] for k in ("actor/pg_loss", "actor/grad_norm")}


def _step_check(st, args, step, out):
    import torch

    from verl_hpc.engines.batch import pack_sequences
    from verl_hpc.resharding import sync
    from verl_hpc.rollout import SamplingSpec

    metrics = sync(st.actor, st.rollout, bucket_mb=step["bucket_mb"])
    greedy = SamplingSpec(temperature=0, max_tokens=args["max_new"])
    res = st.rollout.generate(args["prompts"], greedy)
    batch = pack_sequences([res.prompts[i] for i in res.prompt_index], res.response_ids)
    actor_lp = st.actor.log_probs(batch)["old_log_probs"]
    diff = 0.0
    for row, lps in enumerate(res.logprobs):
        ref = actor_lp[row, :len(lps)]
        diff = max(diff, float((torch.tensor(lps) - ref).abs().max()))
    out["checks"][step["check"]] = dict(
        layout=st.layout, rollout_tp=st.rollout_tp, metrics=metrics,
        response_ids=res.response_ids, logprobs=res.logprobs, actor_logprob_diff=diff)


def _step_digests(st, step, out):
    from verl_hpc.resharding import DigestSink, sync

    runs = []
    for mb in step["digests"]:
        sink = DigestSink()
        metrics = sync(st.actor, sink, bucket_mb=mb)
        runs.append(dict(bucket_mb=mb, records=sink.records, metrics=metrics))
    out["digests"][st.layout] = runs


def _step_tied(st, args, ctx, step, out):
    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.resharding import DigestSink, sync

    model = build_gpt_model(load_arch(args["tied_model"]))
    load_hf_weights(model, args["tied_model"])
    sink = DigestSink()
    metrics = sync(model, sink, bucket_mb=step["tied"])
    # one vLLM engine per process (a second one's close() tears down vLLM's global parallel
    # groups under the first): the scenario's engine makes way and comes back afterwards
    tp = st.rollout_tp
    st.rollout.close()
    st.rollout = None
    vllm = _tied_into_vllm(model, args, step, ctx)
    _step_rollout(st, args, ctx, tp)
    out["tied"][st.layout] = dict(records=sink.records, metrics=metrics, vllm=vllm)


def _tied_into_vllm(model, args, step, ctx):
    """The tied model's weights synced into a vLLM engine (inference TP = world size) that was
    built from another tied model of the same shape: what it then generates must come from the
    synced weights, output projection included (vllm_compat hazard 6)."""
    import torch.distributed as dist

    from verl_hpc.resharding import sync
    from verl_hpc.rollout import SamplingSpec, VLLMRollout

    rollout = VLLMRollout(args["tied_other"], tp=dist.get_world_size(), ctx=ctx, max_num_seqs=16,
                          max_prompt_length=args["max_prompt"], max_response_length=args["max_new"])
    try:
        sync(model, rollout, bucket_mb=step["tied"])
        res = rollout.generate(args["prompts"], SamplingSpec(temperature=0, max_tokens=args["max_new"]))
        return dict(response_ids=res.response_ids, logprobs=res.logprobs)
    finally:
        rollout.close()


def _step_memory(st, args, step, out):
    """Peak extra heap of a sync into a sink that drops what it gets, at each bucket size, from a
    model with a larger vocabulary (so its largest tensor, the embedding, dwarfs heap noise),
    built at the current layout; and into vLLM from the actor, for the record."""
    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.resharding import NullSink, sync
    from verl_hpc.resharding.memory import HeapPeak

    model = build_gpt_model(load_arch(args["memory_model"]))
    load_hf_weights(model, args["memory_model"])
    res = {}
    for mb in step["memory"]:
        sync(model, NullSink(), bucket_mb=mb)  # warm: first-call allocations apart
        with HeapPeak() as mem:
            metrics = sync(model, NullSink(), bucket_mb=mb)
        res[f"null@{mb}"] = dict(peak_bytes=mem.peak_bytes, end_bytes=mem.end_bytes, metrics=metrics)
    with HeapPeak() as mem:
        metrics = sync(st.actor, st.rollout, bucket_mb=step["memory"][0])
    res["vllm"] = dict(peak_bytes=mem.peak_bytes, end_bytes=mem.end_bytes, metrics=metrics)
    out["memory"][st.layout] = res


class _FailingSink:
    """Raises after a few tensors on one rank: the others must not hang in the export."""

    def __init__(self, fail: bool):
        self.fail = fail

    def wake(self):
        pass

    def load_weights(self, weights):
        for k, _ in enumerate(weights):
            if self.fail and k == 3:
                raise ValueError("injected failure")
        return {}


def _step_failure(st, step, out):
    import torch.distributed as dist

    from verl_hpc.resharding import NullSink, SyncError, sync

    try:
        sync(st.actor, _FailingSink(dist.get_rank() == step["failure"]), bucket_mb=1)
        out["failure"] = "no error"
    except SyncError as exc:
        out["failure"] = str(exc)
    out["after_failure_ok"] = sync(st.actor, NullSink(), bucket_mb=1)["sync/tensors"] > 0


def _scenario(workdir: Path) -> None:
    import torch.distributed as dist

    from verl_hpc.runtime import bootstrap

    args = json.loads((workdir / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=240, seed=3)
    out = {"rank": ctx.rank, "updates": {}, "checks": {}, "digests": {}, "memory": {}, "tied": {},
           "seconds": {}}
    st = _State()
    for step in args["steps"]:
        t = time.time()
        if "rollout" in step:
            _step_rollout(st, args, ctx, step["rollout"])
        elif "layout" in step:
            _step_layout(st, args, ctx, step, workdir, out)
        elif "check" in step:
            _step_check(st, args, step, out)
        elif "digests" in step:
            _step_digests(st, step, out)
        elif "tied" in step:
            _step_tied(st, args, ctx, step, out)
        elif "memory" in step:
            _step_memory(st, args, step, out)
        elif "failure" in step:
            _step_failure(st, step, out)
        out["seconds"][json.dumps(step)] = round(time.time() - t, 2)
    (workdir / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    if st.rollout is not None:
        st.rollout.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]))
