"""The Megatron and FSDP engines' bf16 train step vs a plain transformers step on one GPU (~1B Llama,
2,048-token sequences): tokens/s, model TFLOP/s, MFU, peak memory, and the forward-only log-prob pass.

    python benchmarks/bench_gpu_step.py [--cpu-rehearsal] [--out DIR] [--time-limit SECONDS] [--sides ...]

Writes DIR/bench_gpu_step.json (default DIR: outputs/bench_gpu_step) and prints a table. Exit 0 when
every side that can run here ran, 1 on an error; a missed goal is reported, not an error.

The sides run on the same device, batch and weights (one HF folder of random weights, written
first), with the optimizer hyper-parameters of the default config's `actor.optim`:
- engine: `MegatronEngine` (verl_hpc.engines.megatron) as the actor builds it, in bf16: Megatron
  DDP (fp32 gradient buffer), Megatron's mixed-precision Adam (fp32 master weights), clipping;
  `train_step` with response log-probs and a token-mean NLL; `forward` for the log-prob pass.
  Kernels are what auto picks on this machine (engines/megatron/kernels.py). Needs megatron-core:
  where it does not import, this column is reported as not run and the others still run.
- fsdp: `FsdpEngine` (verl_hpc.engines.fsdp) as the actor builds it with parallel.engine=fsdp:
  the transformers model, fully_shard per decoder layer over a one-rank mesh, bf16 compute over
  fp32 master weights with fp32 gradient reduction (fsdp.mixed_precision auto), its AdamW over the
  DTensor shards, clipping; `train_step` and `forward` as the Megatron side.
- transformers: LlamaForCausalLM with fp32 weights under bf16 autocast, SDPA attention, logits of
  the response positions only (`logits_to_keep`, as TRL's GRPO), log_softmax + gather, the same
  loss, backward, clip_grad_norm_, torch.optim.AdamW(fused=True): what TRL / accelerate run. The
  log-prob pass is the same forward under torch.no_grad.

Model FLOPs per step of T = seqs x S tokens (PaLM's MFU convention, appendix B: the half of the
attention that the causal mask skips is counted, whatever a kernel does):
    train   = 6 * N * T + 12 * L * H * S * T
    forward = 2 * N * T +  4 * L * H * S * T
N: parameters that multiply (all but the input embedding table; the output layer counts), L layers,
H = heads x head_dim, S sequence length. TFLOP/s = FLOPs / median seconds. MFU = TFLOP/s / the
board's dense bf16 peak (verl_hpc/config/gpus.py, looked up by the name torch reports; a board the
table does not know gets no MFU).

- transformers_liger: the transformers side with Liger-Kernel as TRL's `use_liger_kernel` applies
  it (RMSNorm, SwiGLU, RoPE; log-probs from its fused linear cross-entropy): the peer to beat.
- variants (--sides), one change each: engine_whole / fsdp_whole (the whole logits always;
  fsdp_whole also without Liger), engine_chunked / fsdp_chunked (chunks of the CPU's fixed budget,
  the output layer before the device rule), fsdp_compile (per-block torch.compile, its recompiles
  logged), fsdp_foreach (torch's foreach AdamW), fsdp_noliger, fsdp_keep (reshard_after_forward
  false), fsdp_loopclip (the per-parameter gradient norm and clip). `--sides gpu-all`: what
  `make gpu-all` runs.

Diagnostics (gpu_step_diag.py), per side in the first round, in its `diagnostics`: one warm step's
kernel profile (time by kernel, busy and idle time, the largest gaps, the optimizer phase's idle
time), its host syncs (the recorder's counts by kind and line; on a GPU set_sync_debug_mode's), and
how the output layer scored and what free memory it read at steps 1, 2 and 3; once per run,
`attention_costs` (causal and dense-masked SDPA per pair, over one token's linear work: prompt
sharing's pair weights on this device).

Goals (issue 75; gpu_step_report.py), on an H100 or H200, against transformers and against
transformers + Liger each: the Megatron engine's train step >= 1.2x tokens/s, the FSDP engine's
>= 1.15x; MFU >= 38% for both; the log-prob pass >= 1.1x. The verdicts are lines of the result
(`goal_lines`), which `make gpu-all`'s summary prints. A side that fails is reported and the
others still run (exit 1).

Timing: the sides take turns in rounds (the order reversed each round), one model on the device at
a time (the one before deleted and its cached blocks released, so each side's peak is its own:
max_memory_allocated over its timed iterations minus what was allocated before it was built).
Warm-up iterations (compilation, the allocator, the optimizer's first state) are excluded; every
timed iteration is synchronized before and after; medians. One extra, untimed iteration per side
runs under torch's profiler to name the kernels used. The log-prob pass's peak includes the
training state each side keeps resident (Megatron keeps its gradient buffer; transformers'
gradients are freed after each step; the FSDP engine holds its sharded gradients at most until its
next step), so the train-step peak is the one to compare. --time-limit bounds the run: fewer timed
iterations and one round when short, and a hard stop (an error) at the limit + 60 s.

Parts: gpu_step_sides.py (the sides; the profiler's operator names), gpu_step_report.py (the
goals' verdicts, the table).

--cpu-rehearsal: tiny shape, gloo on CPU, fp32 without autocast, 1-2 iterations, the output layer's
device rule on a pretended 64 MiB free: the same code end to end, so that the first GPU run does
not find a bug in this script. Its figures are no performance claim.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step_model import (GPU_SHAPE, REHEARSAL_FREE_BYTES, REHEARSAL_SHAPE, Shape, make_batch,  # noqa: E402,F401
                            make_model_folder, model_flops, param_counts, peak_of)
from gpu_step_diag import (attention_costs, kernel_profile, output_layer_read, pretend_device_memory,  # noqa: E402
                           sync_counts)
from gpu_step_report import goal_lines, goals, table  # noqa: E402
from gpu_step_sides import (EngineCpuBudgetSide, EngineSide, EngineWholeLogitsSide, FsdpCompileSide,  # noqa: E402
                            FsdpCpuBudgetSide, FsdpForeachAdamSide, FsdpKeepGatheredSide, FsdpLoopClipSide,
                            FsdpNoLigerSide, FsdpSide, FsdpWholeLogitsSide, compile_problem, profiled_ops,
                            side_problem)
from gpu_step_peers import HFLigerSide, HFSide  # noqa: E402

HARD_STOP_GRACE_S = 60


def timed_loop(fn, max_iters: int, budget_s: float, min_iters: int = 1) -> list:
    """Seconds of each call of fn, synchronized around it; stops after max_iters, or once
    min_iters ran and budget_s is spent."""
    from verl_hpc.runtime.device import synchronize

    times, start = [], time.perf_counter()
    for i in range(max_iters):
        synchronize()
        t = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t)
        if i + 1 >= min_iters and time.perf_counter() - start > budget_s:
            break
    return times


def run_side(cls, folder, shape, batch, plan, loop_budget_s, diagnose: bool = False) -> dict:
    """Build one side, warm up, profile one step, time train and forward, free it (closed whatever
    happens: a side that raises must not leave its patches, Liger's, on the sides after it).
    diagnose: also gpu_step_diag's kernel profile, host syncs and output-layer reads (one round)."""
    from verl_hpc.runtime.device import has_gpu, peak_memory_allocated, release_cached_memory, reset_peak_memory

    release_cached_memory()
    reset_peak_memory()
    before = peak_memory_allocated()  # right after a reset: what is allocated now
    t = time.perf_counter()
    side = cls(folder, shape, plan["dtype"], plan["device"])
    try:
        build_s = time.perf_counter() - t
        first_loss = side.train(batch)  # a warm-up iteration; its loss is before any update
        reads = [output_layer_read(side)]  # what the output layer read at steps 1, 2, 3
        for _ in range(plan["warmup"] - 1):
            side.train(batch)
            reads.append(output_layer_read(side))
        ops = profiled_ops(lambda: side.train(batch))
        reads.append(output_layer_read(side))
        diag = {}
        if diagnose:
            diag["kernel_profile"] = kernel_profile(lambda: side.train(batch), has_gpu())
            reads.append(output_layer_read(side))
            diag["host_syncs"] = sync_counts(lambda: side.train(batch))
            diag["output_layer_steps_1_to_3"] = reads[:3]
        reset_peak_memory()
        train = timed_loop(lambda: side.train(batch), plan["iters"], loop_budget_s, plan["min_iters"])
        peak_train = peak_memory_allocated()
        side.forward(batch)
        ops_fwd = profiled_ops(lambda: side.forward(batch))
        reset_peak_memory()
        forward = timed_loop(lambda: side.forward(batch), plan["iters"], loop_budget_s, plan["min_iters"])
        peak_forward = peak_memory_allocated()
        kernels = side.kernels()
        kernels["profiled_ops"] = {k: sorted(set(v) | set(ops_fwd.get(k, ()))) for k, v in ops.items()}
    finally:
        side.close()
        side = None  # the last reference: its tensors go now
    release_cached_memory()
    reset_peak_memory()
    after = peak_memory_allocated()
    less = (lambda b: None if b is None else b - before)
    return {"build_s": build_s, "first_loss": first_loss, "train_s": train, "forward_s": forward,
            "peak_train_bytes": less(peak_train), "peak_forward_bytes": less(peak_forward),
            "allocated_before_bytes": before, "left_allocated_bytes": less(after), "kernels": kernels,
            "diagnostics": diag}


def summarize(rounds: list, flops: dict, peak_tflops, tokens: int) -> dict:
    """Medians over every timed iteration of every round, and the figures derived from them."""
    out = {}
    for part, key in (("train", "train_s"), ("forward", "forward_s")):
        times = [t for r in rounds for t in r[key]]
        med = statistics.median(times)
        tflops = flops[part] / med / 1e12
        out[part] = {"median_s": med, "iters": len(times), "tok_s": tokens / med, "tflops": tflops,
                     "mfu": tflops / peak_tflops if peak_tflops else None,
                     "peak_bytes": _max_or_none(r[f"peak_{part}_bytes"] for r in rounds)}
    out["first_loss"] = rounds[0]["first_loss"]
    out["build_s"] = [r["build_s"] for r in rounds]
    out["left_allocated_bytes"] = _max_or_none(r["left_allocated_bytes"] for r in rounds)
    out["kernels"] = rounds[0]["kernels"]
    out["diagnostics"] = rounds[0]["diagnostics"]
    return out


def _max_or_none(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


SIDES = {"engine": EngineSide, "engine_whole": EngineWholeLogitsSide, "engine_chunked": EngineCpuBudgetSide,
         "fsdp": FsdpSide, "fsdp_whole": FsdpWholeLogitsSide, "fsdp_chunked": FsdpCpuBudgetSide,
         "fsdp_compile": FsdpCompileSide, "fsdp_foreach": FsdpForeachAdamSide, "fsdp_noliger": FsdpNoLigerSide,
         "fsdp_keep": FsdpKeepGatheredSide, "fsdp_loopclip": FsdpLoopClipSide,
         "transformers": HFSide, "transformers_liger": HFLigerSide}
BASELINES = ("transformers", "transformers_liger")  # the engines are compared with each that ran
# the variants that decide a default first: a short --time-limit drops the ones at the end
RUN_ORDER = ("transformers", "transformers_liger", "engine", "fsdp", "fsdp_keep", "fsdp_loopclip", "fsdp_noliger",
             "engine_chunked", "engine_whole", "fsdp_whole", "fsdp_chunked", "fsdp_foreach", "fsdp_compile")
ENGINES = tuple(s for s in SIDES if s not in BASELINES)
DEFAULT_SIDES = ("engine", "fsdp", "transformers")
# what `make gpu-all` asks for: every figure of the speed goals in one run (docs/gpu.md), and the
# variants that settle issue 85's suspects (fsdp_keep: resharding at one rank; fsdp_loopclip: the
# foreach norm and clip; fsdp_compile: per-block compile and its recompiles)
GPU_ALL_SIDES = ("engine", "engine_chunked", "fsdp", "fsdp_noliger", "fsdp_keep", "fsdp_loopclip", "fsdp_compile",
                 "transformers", "transformers_liger")


def run(args, progress=lambda result: None) -> dict:
    import torch

    from verl_hpc.runtime.bootstrap import bootstrap, shutdown
    from verl_hpc.runtime.device import describe_accelerator, has_gpu
    from verl_hpc.runtime.launch_env import LaunchEnv

    rehearsal = args.cpu_rehearsal
    if not rehearsal and not has_gpu():
        raise RuntimeError("no CUDA device here: run with --cpu-rehearsal to test the script on CPU")
    start = time.perf_counter()
    shape = REHEARSAL_SHAPE if rehearsal else GPU_SHAPE
    if args.seqs:
        shape = dataclasses.replace(shape, seqs=args.seqs)
    asked = [x.strip() for x in (",".join(GPU_ALL_SIDES) if args.sides == "gpu-all" else args.sides).split(",")
             if x.strip()]
    bad = [x for x in asked if x not in SIDES]
    if bad or "transformers" not in asked:
        raise ValueError(f"--sides {args.sides}: a comma list of {', '.join(SIDES)} with transformers in it")
    not_run = {name: why for name in asked if (why := side_problem(name, "cpu" if rehearsal else "cuda"))}
    # the peers first, then the engines as they default, then the variants (the compiled one last:
    # its compilation is the longest), so that a short --time-limit drops variants, not the peers
    sides = sorted((name for name in SIDES if name in asked and name not in not_run), key=RUN_ORDER.index)
    if not set(sides) & set(ENGINES):
        raise RuntimeError(f"no engine side can run here: {not_run}")
    plan = {"dtype": "float32" if rehearsal else "bfloat16", "warmup": 1 if rehearsal else 2,
            "iters": args.iters or (2 if rehearsal else 10), "min_iters": 1 if rehearsal else 3,
            "rounds": 1 if rehearsal else 2}
    env = LaunchEnv(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
                    node_rank=0, master_addr="127.0.0.1", master_port=_free_port())
    ctx = bootstrap(backend="gloo" if rehearsal else "nccl", timeout_s=600, env=env,
                    num_threads=1 if rehearsal else 0)
    if "engine" in sides:
        from verl_hpc.parallel import init_model_parallel

        init_model_parallel(1, 1)
        if has_gpu():
            compile_problem(ctx.device)  # asked once here, so that no build's time includes it
    plan["device"] = ctx.device
    device = "cpu" if rehearsal else describe_accelerator()
    peak_tflops, gpu_key = (None, None) if rehearsal else peak_of(device)
    counts = param_counts(shape)
    flops = model_flops(shape, counts["matmul"])
    batch = make_batch(shape)
    try:  # the pair weights of prompt sharing's cost model, measured here (gpu_step_diag.py)
        attention = attention_costs(shape, ctx.device, getattr(torch, plan["dtype"]))
    except Exception as e:  # a diagnostic: its failure costs no figure
        attention = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    rounds = {name: [] for name in sides}
    failed = {}
    def assemble(partial: bool) -> dict:
        """The result from the rounds so far (partial: written after each side, so that a run
        stopped from outside keeps what it measured; the sides not reached say so)."""
        done = [name for name in sides if rounds[name]]  # a side that failed in its first round has no figures
        if "transformers" not in done:
            raise RuntimeError(f"the transformers side failed: {failed.get('transformers')}")
        summary = {name: summarize(rounds[name], flops, peak_tflops, shape.tokens) for name in done}
        for name, side in summary.items():
            nums = [side["first_loss"], side["train"]["tok_s"], side["forward"]["tok_s"]]
            if not all(math.isfinite(x) and x > 0 for x in nums):
                raise RuntimeError(f"{name}: non-finite or non-positive result: {nums}")
        hf = summary["transformers"]
        waiting = {name: "not reached (the run was stopped)" for name in sides
                   if partial and name not in done and name not in failed}
        result = {
            "ok": True, "partial": partial, "mode": "cpu-rehearsal" if rehearsal else "gpu", "device": device,
            "peak_bf16_tflops": peak_tflops, "gpu_type": gpu_key, "versions": _versions(),
            "model": {**dataclasses.asdict(shape), "head_dim": shape.head_dim, "params": counts["total"],
                      "params_matmul": counts["matmul"]},
            "dtype": plan["dtype"], "autocast": None if rehearsal else "bfloat16", "tokens_per_step": shape.tokens,
            "flops_per_step": flops, "rounds": len(rounds["transformers"]), "warmup_iters": plan["warmup"],
            "sides": done, "not_run": {**not_run, **waiting}, "failed": dict(failed),
            **{name: summary.get(name) for name in SIDES},
            # each engine's tokens/s over transformers' (same batch, weights and device), and over
            # transformers + Liger's where that ran
            "ratios": {name: {part: summary[name][part]["tok_s"] / hf[part]["tok_s"] for part in ("train", "forward")}
                       for name in ENGINES if name in summary},
            "ratios_liger": ({name: {part: summary[name][part]["tok_s"] / summary["transformers_liger"][part]["tok_s"]
                                     for part in ("train", "forward")} for name in ENGINES if name in summary}
                             if "transformers_liger" in summary else {}),
            # same weights and batch: the losses before the first update agree (to bf16 rounding on a GPU)
            "first_loss_abs_diff": {name: abs(summary[name]["first_loss"] - hf["first_loss"])
                                    for name in SIDES if name in summary and name != "transformers"},
            "time_limit_s": args.time_limit, "attention_costs": attention,
        }
        result["goals"] = goals(result, rehearsal, gpu_key)
        result["goal_lines"] = goal_lines(result)  # what `make gpu-all`'s summary prints
        result["elapsed_s"] = time.perf_counter() - start
        return result

    pretend = pretend_device_memory(REHEARSAL_FREE_BYTES) if rehearsal else contextlib.nullcontext()
    with pretend, tempfile.TemporaryDirectory(dir=args.out, prefix="model-") as tmp:
        folder, written = make_model_folder(Path(tmp), shape, getattr(torch, plan["dtype"]), ctx.device)
        if written != counts["total"]:  # the FLOP formula's N must be the model's
            raise RuntimeError(f"parameter count: formula {counts['total']}, HF model {written}")
        # half of what is left for the timed loops (train and forward per side), the rest for
        # builds and warm-ups
        loop_budget = 0.5 * (args.time_limit - (time.perf_counter() - start)) / (2 * len(sides) * plan["rounds"])
        slowest = 0.0  # the longest side so far: a side that would not end within --time-limit is not started
        for r in range(plan["rounds"]):
            t_round = time.perf_counter()
            for name in (sides if r % 2 == 0 else sides[::-1]):
                if name in failed or (r == 0 and name in not_run):
                    continue
                if r == 0 and slowest and time.perf_counter() - start + 1.2 * slowest > args.time_limit:
                    not_run[name] = f"out of time (--time-limit {args.time_limit:.0f} s)"
                    continue
                t_side = time.perf_counter()
                try:
                    rounds[name].append(run_side(SIDES[name], folder, shape, batch, plan, loop_budget,
                                                 diagnose=r == 0))
                    slowest = max(slowest, time.perf_counter() - t_side)
                except Exception as e:  # one side's failure (an OOM, a kernel) must not cost the others' figures
                    failed[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                    _release()
                if rounds["transformers"]:
                    try:
                        progress(assemble(partial=True))
                    except RuntimeError:  # a bad figure: the final assembly says so, with every side's
                        pass
            left = args.time_limit - (time.perf_counter() - start)
            if r + 1 < plan["rounds"] and left < 1.2 * (time.perf_counter() - t_round):
                break  # another round would not end within --time-limit
    result = assemble(partial=False)
    shutdown()
    return result


def _release() -> None:
    import gc

    from verl_hpc.runtime.device import release_cached_memory

    gc.collect()
    release_cached_memory()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    try:
        megatron = version("megatron-core")
    except PackageNotFoundError:
        megatron = None
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "megatron-core": megatron}


def _hard_stop(limit_s: float) -> None:
    def stop(signum, frame):
        raise TimeoutError(f"--time-limit {limit_s:.0f} s + {HARD_STOP_GRACE_S} s passed")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(int(limit_s) + HARD_STOP_GRACE_S)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="tiny shape, gloo, fp32 on CPU: tests this script, measures nothing")
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench_gpu_step"),
                    help="folder for bench_gpu_step.json (and the temporary model)")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole run")
    ap.add_argument("--iters", type=int, default=0, help="timed iterations per side and round (at most)")
    ap.add_argument("--seqs", type=int, default=0, help="sequences per step (default: the shape's)")
    ap.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                    help="comma list of engine (Megatron), fsdp, transformers, transformers_liger (the peer "
                         "TRL's use_liger_kernel runs), and the engines' variants engine_whole / fsdp_whole "
                         "(whole logits always; fsdp_whole also without Liger), engine_chunked / fsdp_chunked "
                         "(the CPU's fixed chunk budget), fsdp_compile (per-block torch.compile), fsdp_foreach "
                         "(foreach AdamW), fsdp_noliger, fsdp_keep (reshard_after_forward false), fsdp_loopclip "
                         "(the per-parameter norm and clip); 'gpu-all' = " + ",".join(GPU_ALL_SIDES) + ". A side "
                         "that cannot be built here (no megatron-core, no liger-kernel or GPU, no compiler) is "
                         "reported as not run; one that fails is reported and the others still run (exit 1)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VERL_HPC_LOGLEVEL", "WARNING")
    if args.cpu_rehearsal:  # on CPU also where a GPU is visible: gloo and fp32 are CPU paths
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA first initialises, which is later
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "bench_gpu_step.json"
    _hard_stop(args.time_limit)
    try:
        result = run(args, lambda partial: path.write_text(json.dumps(partial, indent=2)))
    except Exception as e:  # the JSON says what failed; the exit code says that it failed
        path.write_text(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()}, indent=2))
        print(f"bench_gpu_step: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    path.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"wrote {path}")
    if result["failed"]:
        print("bench_gpu_step: FAILED sides: " + "; ".join(f"{k}: {v}" for k, v in result["failed"].items()),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
