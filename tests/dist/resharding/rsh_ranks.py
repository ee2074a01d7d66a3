"""Spawn gloo ranks that run the resharding scenario under the project's runtime.

`launch(n, args, workdir)` starts n copies of this file with torchrun-style variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), so `verl_hpc.runtime.bootstrap()` brings each rank up
as in a real job. Each rank writes rank{r}.json; global rank 0 saves the exported weights of each
layout as `<layout>.state.pt` for the test to build a transformers model from. A failing rank
fails the launch with every rank's log tail.

The scenario is `scenario()` below, plain code read top to bottom: one process set for all the
checks, since spawning ranks and importing Megatron and vLLM costs far more than the checks.
`args` (args.json) carries only the test's inputs: model folders, prompts, lengths, the LR.
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


def _build_rollout(args, ctx, tp: int):
    """A vLLM engine at inference TP `tp` (one replica per `tp` ranks)."""
    from verl_hpc.rollout import build_rollout
    from verl_hpc.trainer.roles import rollout_options

    cfg = _job_config(args, 1, 1)
    cfg.rollout.tp = tp
    return build_rollout(rollout_options(cfg), ctx, max_num_seqs=16)


def _train_at(args, ctx, layout: str, tp: int, pp: int, workdir, out):
    """(Re)initialise Megatron at tp x pp, build the actor from the job config, run one
    Actor.update; rank 0 saves the exported weights for the test."""
    import torch
    import torch.distributed as dist

    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.trainer.roles import build_engine
    from verl_hpc.parallel import destroy_model_parallel, init_model_parallel

    destroy_model_parallel()
    init_model_parallel(tp, pp, seed=1)
    cfg = _job_config(args, tp, pp)
    actor = build_engine("actor", cfg, ctx)
    batch = train_batch()
    batch["old_log_probs"] = actor.log_probs(batch)["old_log_probs"]
    metrics = actor.update(batch, PolicyObjective.from_config(cfg.actor))
    state = {n: t.clone() for n, t in actor.engine.export_hf_weights()}
    if dist.get_rank() == 0:
        torch.save(state, Path(workdir) / f"{layout}.state.pt")
    out["updates"][layout] = {k: metrics[k] for k in ("actor/pg_loss", "actor/grad_norm")}
    return actor


def check_sync(actor, rollout, args, *, layout: str, rollout_tp: int, bucket_mb: float) -> dict:
    """Sync the actor into vLLM, greedy generate, recompute the rollout's log-probs with the actor
    (engine.forward)."""
    import torch

    from verl_hpc.engines.batch import pack_sequences
    from verl_hpc.resharding import sync
    from verl_hpc.rollout.sampling import default_spec

    rollout.wake(tags=("weights",))  # the trainer's order: weights, sync, KV cache (no-ops on CPU)
    metrics = sync(actor, rollout, bucket_mb=bucket_mb)
    rollout.wake(tags=("kv_cache",))
    greedy = default_spec(temperature=0, max_tokens=args["max_new"])
    res = rollout.generate(args["prompts"], greedy)
    batch = pack_sequences([res.prompts[i] for i in res.prompt_index], res.response_ids)
    actor_lp = actor.log_probs(batch)["old_log_probs"]
    diff = 0.0
    for row, lps in enumerate(res.logprobs):
        ref = actor_lp[row, :len(lps)]
        diff = max(diff, float((torch.tensor(lps) - ref).abs().max()))
    return dict(layout=layout, rollout_tp=rollout_tp, metrics=metrics, response_ids=res.response_ids,
                logprobs=res.logprobs, actor_logprob_diff=diff)


def sync_digests(actor, bucket_sizes) -> list:
    """Sync into a DigestSink at each bucket size over the full-tensor path, then once over the
    sliced path (a DigestSink keeps whole tensors), for a bitwise comparison."""
    from verl_hpc.resharding import DigestSink, sync

    runs = []
    for mb in bucket_sizes:
        sink = DigestSink()
        metrics = sync(actor, sink, bucket_mb=mb, mode="full")
        runs.append(dict(bucket_mb=mb, records=sink.records, metrics=metrics))
    sink = DigestSink()
    metrics = sync(actor, sink, bucket_mb=bucket_sizes[0], mode="sliced")
    runs.append(dict(bucket_mb=bucket_sizes[0], records=sink.records, metrics=metrics))
    return runs


def sync_modes(actor, rollout, args) -> dict:
    """The same weights into vLLM over the full path, the sliced path and the sliced delta path
    (twice: dense, then a delta of nothing): the greedy tokens and log-probs after each must be
    identical, bit for bit, since the engine must hold the same weights."""
    from verl_hpc.resharding import WeightSync
    from verl_hpc.rollout.sampling import default_spec

    greedy = default_spec(temperature=0, max_tokens=args["max_new"])
    out = {}
    # every sync read back: what vLLM serves must equal what each path sent (resharding/served_check.py)
    delta = WeightSync(bucket_mb=SMALL_MB, mode="sliced", delta=True, check_served_every=1)
    for label, syncer in (("full", WeightSync(bucket_mb=SMALL_MB, mode="full", check_served_every=1)),
                          ("sliced", WeightSync(bucket_mb=SMALL_MB, mode="sliced", check_served_every=1)),
                          ("delta_dense", delta), ("delta_nothing", delta)):
        metrics = syncer(actor, rollout)
        res = rollout.generate(args["prompts"], greedy)
        out[label] = dict(metrics=metrics, response_ids=res.response_ids, logprobs=res.logprobs)
    return out


def tied_model_sync(args, ctx, bucket_mb: float) -> dict:
    """A Megatron model of args["tied_model"] (tied embeddings, not updated) at the current
    layout, synced into a DigestSink and into a vLLM engine built from args["tied_other"]. The
    caller must have closed its own engine: one vLLM engine per process (a second one's close()
    tears down vLLM's global parallel groups under the first)."""
    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.resharding import DigestSink, sync

    model = build_gpt_model(load_arch(args["tied_model"]))
    load_hf_weights(model, args["tied_model"])
    sink = DigestSink()
    metrics = sync(model, sink, bucket_mb=bucket_mb)
    return dict(records=sink.records, metrics=metrics, vllm=_tied_into_vllm(model, args, bucket_mb, ctx))


def _tied_into_vllm(model, args, bucket_mb, ctx):
    """The tied model's weights synced into a vLLM engine (inference TP = world size) that was
    built from another tied model of the same shape: what it then generates must come from the
    synced weights, output projection included (vllm_compat hazard 6)."""
    import torch.distributed as dist

    from verl_hpc.resharding import WeightSync
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec

    rollout = VLLMRollout(args["tied_other"], tp=dist.get_world_size(), ctx=ctx, max_num_seqs=16,
                          **default_engine_args("vllm", max_prompt_length=args["max_prompt"],
                                                max_response_length=args["max_new"]))
    try:
        served = WeightSync(bucket_mb=bucket_mb, check_served_every=0)(model, rollout)["sync/served_checked"]
        res = rollout.generate(args["prompts"], default_spec(temperature=0, max_tokens=args["max_new"]))
        return dict(response_ids=res.response_ids, logprobs=res.logprobs, served_checked=served,
                    head_of_its_own=all(rollout.llm.apply_model(_head_of_its_own)))
    finally:
        rollout.close()


def _head_of_its_own(model) -> bool:
    """Whether vLLM's model ties an output head module of its own to the embedding (vLLM 0.32's
    Qwen2) rather than using the embedding module as its head (0.25's): the served-weights check
    reads the head's packed copy back only in the first case."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return any(isinstance(m, ParallelLMHead) for m in model.modules())


def sync_memory(actor, rollout, args, bucket_sizes) -> dict:
    """Peak extra heap of a sync into a sink that drops what it gets, at each bucket size, from a
    model with a larger vocabulary (so its largest tensor, the embedding, dwarfs heap noise),
    built at the current layout; and into vLLM from the actor, for the record."""
    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.resharding import NullSink, sync
    from verl_hpc.resharding.memory import HeapPeak

    model = build_gpt_model(load_arch(args["memory_model"]))
    load_hf_weights(model, args["memory_model"])
    res = {}
    for mb in bucket_sizes:
        sync(model, NullSink(), bucket_mb=mb, mode="full")  # warm: first-call allocations apart
        with HeapPeak() as mem:
            metrics = sync(model, NullSink(), bucket_mb=mb, mode="full")
        res[f"null@{mb}"] = dict(peak_bytes=mem.peak_bytes, end_bytes=mem.end_bytes, metrics=metrics)
    with HeapPeak() as mem:
        metrics = sync(actor, rollout, bucket_mb=bucket_sizes[0], mode="full")
    res["vllm"] = dict(peak_bytes=mem.peak_bytes, end_bytes=mem.end_bytes, metrics=metrics)
    with HeapPeak() as mem:
        metrics = sync(actor, rollout, bucket_mb=bucket_sizes[0], mode="sliced")
    res["vllm_sliced"] = dict(peak_bytes=mem.peak_bytes, end_bytes=mem.end_bytes, metrics=metrics)
    return res


class _FailingSink:
    """Raises after a few tensors on one rank: the others must not hang in the export."""

    def __init__(self, fail: bool):
        self.fail = fail

    def weight_slices(self):
        return 0, 1  # keeps whole tensors: the sliced path applies too

    def load_weights(self, weights):
        for k, _ in enumerate(weights):
            if self.fail and k == 3:
                raise ValueError("injected failure")
        return {}


def sync_failing_on(actor, rank: int, out) -> None:
    """A sink that raises on `rank`, over the full and the sliced path (a bucket of 0.05 MB: the
    failure comes with exchanges still to run): every rank must raise SyncError, and a sync still
    works after."""
    import torch.distributed as dist

    from verl_hpc.resharding import NullSink, SyncError, sync

    for mode in ("full", "sliced"):
        key = "failure" if mode == "full" else "failure_sliced"
        try:
            sync(actor, _FailingSink(dist.get_rank() == rank), bucket_mb=SMALL_MB, mode=mode)
            out[key] = "no error"
        except SyncError as exc:
            out[key] = str(exc)
        out[f"after_{key}_ok"] = sync(actor, NullSink(), bucket_mb=1, mode=mode)["sync/tensors"] > 0


SMALL_MB = 0.05  # 51 KiB: smaller than the embedding (256 KB) and the fused fc1 / qkv weights


def scenario(args, ctx, workdir: Path, out: dict, timed) -> None:
    """The table of tests/dist/resharding/test_rsh_dist.py's docstring, in its order."""
    with timed("build vLLM at inference TP2"):
        rollout = _build_rollout(args, ctx, tp=2)

    with timed("train at PP2"):
        actor = _train_at(args, ctx, "pp2", tp=1, pp=2, workdir=workdir, out=out)
    with timed("PP2 -> inference TP2"):
        out["checks"]["pp2->inf_tp2"] = check_sync(actor, rollout, args, layout="pp2", rollout_tp=2,
                                                   bucket_mb=SMALL_MB)
        out["digests"]["pp2"] = sync_digests(actor, [SMALL_MB, 512])
    with timed("tied embeddings at PP2"):
        rollout.close()  # one vLLM engine per process: ours makes way for the tied model's
        out["tied"]["pp2"] = tied_model_sync(args, ctx, SMALL_MB)
        rollout = _build_rollout(args, ctx, tp=2)

    with timed("train at TP2"):
        actor = None  # the PP2 actor's model goes before Megatron is re-initialised
        actor = _train_at(args, ctx, "tp2", tp=2, pp=1, workdir=workdir, out=out)
    with timed("TP2 -> inference TP2"):
        out["checks"]["tp2->inf_tp2"] = check_sync(actor, rollout, args, layout="tp2", rollout_tp=2,
                                                   bucket_mb=1)
        out["digests"]["tp2"] = sync_digests(actor, [SMALL_MB, 512])
        out["memory"]["tp2"] = sync_memory(actor, rollout, args, [1, 8])
        out["modes"]["tp2->inf_tp2"] = sync_modes(actor, rollout, args)
        sync_failing_on(actor, 1, out)

    with timed("TP2 -> inference TP1 (2 replicas)"):
        rollout.close()
        rollout = _build_rollout(args, ctx, tp=1)
        out["checks"]["tp2->inf_tp1"] = check_sync(actor, rollout, args, layout="tp2", rollout_tp=1,
                                                   bucket_mb=SMALL_MB)
        out["modes"]["tp2->inf_tp1"] = sync_modes(actor, rollout, args)
    rollout.close()


def main(workdir: Path) -> None:
    import contextlib

    import torch.distributed as dist

    from verl_hpc.runtime import bootstrap

    args = json.loads((workdir / "args.json").read_text())
    ctx = bootstrap(backend="gloo", num_threads=1, timeout_s=240, seed=3)
    out = {"rank": ctx.rank, "updates": {}, "checks": {}, "digests": {}, "memory": {}, "tied": {},
           "modes": {}, "seconds": {}}

    @contextlib.contextmanager
    def timed(label):
        t = time.time()
        yield
        out["seconds"][label] = round(time.time() - t, 2)

    scenario(args, ctx, workdir, out, timed)
    (workdir / f"rank{ctx.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
