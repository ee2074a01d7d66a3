"""The training engines' forward+backward throughput against transformers, and what layouts cost on CPU.

    python benchmarks/bench_engine.py [--quick] [--threads 2] [--layouts tp1,tp2,pp2,dp2,sp2] [--compile]
    python benchmarks/bench_engine.py --skip-peer --layouts sp2       # only sp=2 vs sp=1

1. Peer ratios (one process, one rank): `MegatronEngine.forward_backward` (TP=1; the schedule,
   response log-probs from vocab-parallel logits, a token-mean NLL loss callback) and
   `FsdpEngine.forward_backward` (FSDP2 over a one-rank mesh: the HF model as transformers builds
   it, sharded per decoder layer, its own log-probs of the kept positions) against transformers'
   LlamaForCausalLM (SDPA attention) doing forward + the same loss + backward on the same weights
   and batch. Iterations alternate between the sides; medians are compared.
   Goals: Megatron >= 0.9, FSDP >= 0.95 of transformers.
   --compile adds a fourth side, the FSDP engine with `fsdp.compile` (torch.compile per decoder
   layer after sharding): its first iteration's extra seconds (the compilation, from a fresh
   inductor cache unless --compile-cache names one) apart from its steady-state iterations, which
   alternate with the others.
2. Layout cost (CPU, same total cores): Megatron fwd+bwd tokens/s at TP2 and PP2 on 2 ranks
   (1 thread each) relative to TP1 on 1 rank (2 threads); 4 micro-batches of 2 sequences at every
   layout (PP needs several micro-batches to overlap its stages).
3. FSDP against Megatron at 2 ranks, data parallel 2 (1 thread each): the train step (forward,
   backward, the gradient reduction, clipping and AdamW: FSDP reduce-scatters in its backward,
   Megatron in `finalize_model_grads` after it, so the whole step is the fair unit), each engine
   as the default config builds it (Megatron's distributed optimizer), 2 micro-batches of 2 a rank.
   Each rank's model-state bytes (distinct storages behind its parameters, gradients and Adam's
   moments, measured after the timed updates and one more forward+backward, so that the gradients
   are held) beside the memory plan's
   `update_actor` actor column for the same job (`python -m verl_hpc.plan`'s rows).
   Layout runs alternate (the order rotated each repeat); medians.
4. Ulysses sequence parallelism on the FSDP engine (`--layouts sp2`): the train step's tokens/s at
   fsdp.sp = 2 (data-parallel 1: both ranks share each sequence, an all-to-all regroups q, k, v
   and the attention output per layer) against sp = 1 (data-parallel 2: each rank its own rows),
   on the same 2 gloo ranks x 1 thread, the same model and the same batch of long rows
   (4 x 2,048 tokens, 32-token prompts). Micro-batches of sp rows: each rank runs 2 of 2,048 tokens
   at either sp (a whole row at sp 1, halves of two rows at sp 2): the same activation memory and
   the same FSDP gathers and gradient reductions, so the ratio is the price of the all-to-alls
   and their copies. Reported as sp2 / sp1.

Model (docs/platform-notes.md, "Reference model and figures"): Llama-style, hidden 512, 8 heads,
4 KV heads, head_dim 64, 6 layers, ffn 1408, vocab 8000 (25.9M parameters), random weights, fp32;
batch 8 x 256 tokens (32-token prompts, 224-token responses). --quick: 2 layers, fewer iterations.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQS, SEQ_LEN, PROMPT = 8, 256, 32
LONG_SEQS, LONG_LEN = 4, 2048  # the sequence-parallel comparison's rows (section 4)
# name -> (engine, tp, pp, processes, threads per process or 0 = --threads, what is timed)
LAYOUTS = {"tp1": ("megatron", 1, 1, 1, 0, "fwdbwd"), "tp2": ("megatron", 2, 1, 2, 1, "fwdbwd"),
           "pp2": ("megatron", 1, 2, 2, 1, "fwdbwd"),
           "megatron_dp2": ("megatron", 1, 1, 2, 1, "train"), "fsdp_dp2": ("fsdp", 1, 1, 2, 1, "train"),
           "fsdp_sp1": ("fsdp", 1, 1, 2, 1, "train"), "fsdp_sp2": ("fsdp", 1, 1, 2, 1, "train")}
LAYOUT_GROUPS = {"tp1": ("tp1",), "tp2": ("tp2",), "pp2": ("pp2",), "dp2": ("megatron_dp2", "fsdp_dp2"),
                 "sp2": ("fsdp_sp1", "fsdp_sp2")}
SP = {"fsdp_sp1": 1, "fsdp_sp2": 2}  # fsdp.sp of the sequence-parallel comparison's layouts (long rows)


def make_model(folder: Path, quick: bool) -> Path:
    from verl_hpc.models.tiny import make_tiny_model

    if (folder / "config.json").exists():
        return folder
    # max_positions covers the long rows (Llama's RoPE frequencies do not depend on it)
    return make_tiny_model(folder, "llama", layers=2 if quick else 6, vocab_size=8000, hidden=512,
                           heads=8, kv_heads=4, head_dim=64, ffn=1408, max_positions=LONG_LEN, seed=0)


def make_batch(long: bool = False):
    import torch

    from verl_hpc.engines.batch import pack_sequences

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 8000, (LONG_SEQS, LONG_LEN) if long else (SEQS, SEQ_LEN), generator=g)
    return pack_sequences([r[:PROMPT].tolist() for r in ids], [r[PROMPT:].tolist() for r in ids])


def nll_loss(out, mb, counts):
    """token-mean negative log-likelihood of the response tokens (a contribution: global count)."""
    return -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens, {}


def hf_step(model, batch):
    """transformers: forward, log-softmax at the response positions, the same loss, backward."""
    import torch

    logits = model(batch["input_ids"]).logits[:, PROMPT - 1:-1]
    tokens = batch["input_ids"][:, PROMPT:]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    loss = -logp.mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item()


def build_engine(folder, micro_batch_size, engine: str = "megatron", compile: bool = False,
                 distributed_optimizer: bool = False, sp: int = 1):
    """An engine from the default config's actor options with a fixed micro-batch size."""
    import dataclasses

    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.options import default_options

    o = default_options(str(folder), engine=engine, optim=OptimConfig(lr=1e-5),
                        micro_batch_size=micro_batch_size, max_tokens_per_microbatch=0)
    if engine == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return FsdpEngine(dataclasses.replace(o, fsdp=dataclasses.replace(o.fsdp, compile=compile, sp=sp)))
    from verl_hpc.engines.megatron import MegatronEngine

    return MegatronEngine(dataclasses.replace(o, use_distributed_optimizer=distributed_optimizer))


def timed(fn):
    """(wall seconds, CPU seconds of this process). On a shared machine the CPU time is the
    steadier measure of work; wall time includes waiting for other jobs' threads."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def state_bytes(engine) -> dict:
    """Bytes of the distinct storages behind this rank's parameters, gradients and optimizer
    states (the FSDP engine's local shards; Megatron's params, main-grad buffers, Adam states)."""
    import torch

    from verl_hpc.engines.offload import engine_tensors

    t = engine_tensors(engine)
    if not t["grads"]:  # the FSDP engine lists no grads (they are dropped at each update)
        t["grads"] = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                      for p in engine.model.parameters() if p.grad is not None]
    seen, out = set(), {}
    for part in ("params", "grads", "optimizer"):
        total = 0
        for x in t[part]:
            if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes():
                ptr = x.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += x.untyped_storage().nbytes()
        out[part] = total
    return out


def planned_state_bytes(folder, engine: str, ranks: int) -> float:
    """The memory plan's update_actor actor bytes (weights + grads + Adam) per rank for this
    layout on this engine (`python -m verl_hpc.plan`'s rows)."""
    from verl_hpc.config import load_config
    from verl_hpc.planning import plan_job

    cfg = load_config(None, [f"model.path={folder}", "model.dtype=float32", "slurm.gpus_per_node=0",
                             "slurm.nodes=1", f"slurm.tasks_per_node={ranks}", f"parallel.engine={engine}",
                             "ref.enable=false", "critic.enable=false", f"data.max_prompt_length={PROMPT}",
                             f"data.max_response_length={SEQ_LEN - PROMPT}", "actor.micro_batch_size=2",
                             "actor.max_tokens_per_microbatch=0"])
    return float(plan_job(cfg).table["update_actor"]["actor"])


def worker(args) -> None:
    """One rank of a layout run (launched with torchrun-style variables); rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from verl_hpc.runtime import bootstrap

    bootstrap(backend="gloo", num_threads=args.threads)
    if args.engine == "megatron":
        from verl_hpc.parallel import init_model_parallel

        init_model_parallel(args.tp, args.pp)
    train = args.op == "train"
    long = args.sp > 0  # the sequence-parallel comparison: long rows
    # sp rows a micro-batch: every rank runs 2 micro-batches of 2,048 tokens at either sp (one whole
    # row at sp 1, two half rows at sp 2), so the same activations and the same number of FSDP
    # gathers and reductions; what differs is the regrouping
    engine = build_engine(args.model, micro_batch_size=max(args.sp, 1) if long else 2, engine=args.engine,
                          distributed_optimizer=train, sp=max(args.sp, 1))
    batch = make_batch(long)
    step = (lambda: engine.train_step(batch, nll_loss)) if train else \
        (lambda: engine.forward_backward(batch, nll_loss))
    for _ in range(args.warmup):
        step()
    times, cpu = [], []
    for _ in range(args.iters):
        dist.barrier()
        w, c = timed(step)
        times.append(w)
        cpu.append(c)
    t, c = torch.tensor(times), torch.tensor(cpu)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
    dist.all_reduce(c, op=dist.ReduceOp.MAX)
    result = {"median_s": statistics.median(t.tolist()), "cpu_median_s": statistics.median(c.tolist())}
    if train:  # the states after updates, with the gradients of one more backward in place
        engine.forward_backward(batch, nll_loss)
        result["state_bytes"] = state_bytes(engine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def peer_ratio(folder, args) -> dict:
    """The engines at one rank vs transformers in this process, alternating iterations."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_hpc.parallel import init_model_parallel
    from verl_hpc.runtime import bootstrap

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    bootstrap(backend="gloo", num_threads=args.threads)
    init_model_parallel(1, 1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    hf.train()
    batch = make_batch()
    sides = {"megatron": build_engine(folder, SEQS), "fsdp": build_engine(folder, SEQS, "fsdp")}
    if args.compile:
        sides["fsdp_compiled"] = build_engine(folder, SEQS, "fsdp", compile=True)
    runs = {name: (lambda e=e: e.forward_backward(batch, nll_loss)) for name, e in sides.items()}
    runs["transformers"] = lambda: hf_step(hf, batch)
    first = {name: timed(fn) for name, fn in runs.items()}  # compilation happens here
    loss = {name: float(e.forward_backward(batch, nll_loss)[0]["loss"]) for name, e in sides.items()}
    loss["transformers"] = hf_step(hf, batch)
    for _ in range(args.warmup):
        for fn in runs.values():
            fn()
    times = {name: [] for name in runs}
    for i in range(args.iters):
        names = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]  # rotated: no side always first
        for name in names:
            times[name].append(timed(runs[name]))
    tokens = SEQS * SEQ_LEN
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    out = {"tok_s": {k: tokens / v for k, v in wall.items()},
           "tok_cpu_s": {k: tokens / v for k, v in cpu.items()},
           "ratio": {k: wall["transformers"] / v for k, v in wall.items() if k != "transformers"},
           "cpu_ratio": {k: cpu["transformers"] / v for k, v in cpu.items() if k != "transformers"},
           "first_s": {k: v[0] for k, v in first.items()}, "median_s": wall, "loss": loss,
           "params_m": sum(p.numel() for p in hf.parameters()) / 1e6}
    if args.compile:  # the first call's time beyond a steady-state iteration: the compilation (wall
        # time only: inductor builds its C++ kernels in worker processes, not in this one's CPU time)
        out["compile_s"] = first["fsdp_compiled"][0] - wall["fsdp_compiled"]
    return out


def layout_runs(folder, names, args) -> dict:
    medians = {k: [] for k in names}
    cpu = {k: [] for k in names}
    states = {}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            engine, tp, pp, nproc, threads, op = LAYOUTS[name]
            threads = threads or args.threads
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={29700 + 10 * rep + list(LAYOUTS).index(name)}",
                   __file__, "--worker", "--model", str(folder), "--engine", engine, "--op", op,
                   "--tp", str(tp), "--pp", str(pp), "--threads", str(threads), "--iters", str(args.iters),
                   "--warmup", str(args.warmup), "--sp", str(SP.get(name, 0))]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), VERL_HPC_LOGLEVEL="WARNING",
                       PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            res = json.loads(line[0][7:])
            medians[name].append(res["median_s"])
            cpu[name].append(res["cpu_median_s"])
            if "state_bytes" in res:
                states[name] = res["state_bytes"]
    tok_s = {k: (LONG_SEQS * LONG_LEN if k in SP else SEQS * SEQ_LEN) / statistics.median(v)
             for k, v in medians.items()}
    out = {"tok_s": tok_s, "runs_s": medians, "state_bytes": states}
    if "tp1" in tok_s:
        out["relative_to_tp1"] = {k: v / tok_s["tp1"] for k, v in tok_s.items() if k in ("tp1", "tp2", "pp2")}
    if {"megatron_dp2", "fsdp_dp2"} <= set(tok_s):
        out["fsdp_over_megatron_dp2"] = tok_s["fsdp_dp2"] / tok_s["megatron_dp2"]
        out["plan"] = {k: planned_state_bytes(folder, LAYOUTS[k][0], 2) for k in ("megatron_dp2", "fsdp_dp2")}
    if set(SP) <= set(tok_s):
        out["sp2_over_sp1"] = tok_s["fsdp_sp2"] / tok_s["fsdp_sp1"]
        # CPU seconds of the slowest rank: on a shared machine the steadier measure of the work
        cpu_s = {k: statistics.median(cpu[k]) for k in SP}
        out["sp_cpu_s"] = cpu_s
        out["sp2_over_sp1_cpu"] = cpu_s["fsdp_sp1"] / cpu_s["fsdp_sp2"]
    return out


def report(peer, lay, args, load) -> None:
    if peer is None:
        return report_layouts(lay, args)
    print(f"model {peer['params_m']:.1f}M params, batch {SEQS} x {SEQ_LEN} tokens, {args.threads} threads, "
          f"{args.iters} iterations (median), {args.warmup} warm-up; load average {load[0]:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end")
    print("loss: " + "  ".join(f"{k} {v:.6f}" for k, v in peer["loss"].items()))
    goals = {"megatron": 0.9, "fsdp": 0.95, "fsdp_compiled": 0.95}
    for name, ratio in peer["ratio"].items():
        print(f"fwd+bwd 1 rank wall: {name} {peer['tok_s'][name]:.0f} tok/s, transformers "
              f"{peer['tok_s']['transformers']:.0f} tok/s, ratio {ratio:.3f} (goal >= {goals[name]}); "
              f"CPU time ratio {peer['cpu_ratio'][name]:.3f}")
    if "compile_s" in peer:
        print(f"fsdp.compile: first fwd+bwd {peer['first_s']['fsdp_compiled']:.1f} s, of which compilation "
              f"{peer['compile_s']:.1f} s (cold inductor cache unless --compile-cache); steady state "
              f"{peer['median_s']['fsdp_compiled']:.3f} s vs eager {peer['median_s']['fsdp']:.3f} s "
              f"({peer['median_s']['fsdp'] / peer['median_s']['fsdp_compiled']:.3f}x)")
    report_layouts(lay, args)


def report_layouts(lay, args) -> None:
    if lay is None:
        return
    for name in ("tp1", "tp2", "pp2"):
        if name in lay.get("relative_to_tp1", {}):
            print(f"fwd+bwd {name.upper()}: {lay['tok_s'][name]:.0f} tok/s, "
                  f"{lay['relative_to_tp1'][name]:.3f} x TP1 ({args.repeats} alternated runs)")
    if "fsdp_over_megatron_dp2" in lay:
        m, f = lay["tok_s"]["megatron_dp2"], lay["tok_s"]["fsdp_dp2"]
        print(f"train step DP2 (2 ranks x 1 thread): megatron {m:.0f} tok/s, fsdp {f:.0f} tok/s, "
              f"fsdp / megatron {lay['fsdp_over_megatron_dp2']:.3f} ({args.repeats} alternated runs)")
        mib = 2 ** 20
        for name in ("megatron_dp2", "fsdp_dp2"):
            st, plan = lay["state_bytes"][name], lay["plan"][name]
            total = sum(st.values())
            print(f"  {name} rank 0 model state: params {st['params'] / mib:.1f} + grads {st['grads'] / mib:.1f} "
                  f"+ optimizer {st['optimizer'] / mib:.1f} = {total / mib:.1f} MiB; plan {plan / mib:.1f} "
                  f"MiB: measured / plan {total / plan:.3f}")
    if "sp2_over_sp1" in lay:
        one, two = lay["tok_s"]["fsdp_sp1"], lay["tok_s"]["fsdp_sp2"]
        print(f"FSDP train step, {LONG_SEQS} rows x {LONG_LEN} tokens (2 ranks x 1 thread): sp=1 (dp 2) {one:.0f} "
              f"tok/s, sp=2 (dp 1) {two:.0f} tok/s, sp2 / sp1 {lay['sp2_over_sp1']:.3f} ({args.repeats} "
              f"alternated runs); CPU time per step sp=1 {lay['sp_cpu_s']['fsdp_sp1']:.2f} s, sp=2 "
              f"{lay['sp_cpu_s']['fsdp_sp2']:.2f} s: ratio {lay['sp2_over_sp1_cpu']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per job (split over ranks)")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0, help="alternated layout runs")
    ap.add_argument("--model", default="")
    ap.add_argument("--layouts", default="tp1,tp2,pp2,dp2,sp2", help=f"comma list of {', '.join(LAYOUT_GROUPS)}")
    ap.add_argument("--compile", action="store_true", help="also time the FSDP engine with fsdp.compile")
    ap.add_argument("--compile-cache", default="",
                    help="inductor's cache folder for --compile (default: a fresh one, i.e. a cold compilation)")
    ap.add_argument("--json", default="", help="write the results to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="megatron", help=argparse.SUPPRESS)
    ap.add_argument("--op", default="fwdbwd", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--skip-layouts", action="store_true")
    ap.add_argument("--skip-peer", action="store_true", help="only the layout runs (sections 2-4)")
    ap.add_argument("--sp", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("VERL_HPC_LOGLEVEL", "WARNING")
    args.iters = args.iters or (3 if args.quick else 7)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.worker:
        return worker(args)
    groups = [g.strip() for g in args.layouts.split(",") if g.strip()]
    bad = [g for g in groups if g not in LAYOUT_GROUPS]
    if bad:
        sys.exit(f"bench_engine: --layouts {','.join(bad)}: not one of {', '.join(LAYOUT_GROUPS)}")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(args.model) if args.model else Path(tmp) / "model", args.quick)
        if args.compile:  # inductor's cache in a folder of this run: the compilation timed is a cold one
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.compile_cache or str(Path(tmp) / "inductor")
        peer = None if args.skip_peer else peer_ratio(folder, args)
        lay = None if args.skip_layouts else layout_runs(folder, [n for g in groups for n in LAYOUT_GROUPS[g]], args)
    if args.json:
        Path(args.json).write_text(json.dumps({"peer": peer, "layouts": lay, "load_start": load,
                                               "load_end": os.getloadavg()}, indent=1))
    report(peer, lay, args, load)


if __name__ == "__main__":
    main()
