"""Where the rollout phase's time goes: the job's rollout phase against vLLM's bare `LLM.generate` of
the same requests on the same engine, eager and compiled.

    python benchmarks/bench_rollout_overhead.py                     # eager and compiled, 5 repeats each
    python benchmarks/bench_rollout_overhead.py --modes eager --repeats 3 --threads 1

The model is SmolLM2-135M-Instruct's shape (Llama, hidden 576, 30 layers, 9 heads, 3 KV heads, FFN
1536, a tied 49,152-token vocabulary), random weights, built here with the project's tokenizer
(bench_vs_trl.py's `135m` size, its model and synthetic "a+b=" data reused under --out). Each mode
(`rollout.enforce_eager` true / false) runs in a process of its own, which builds the RL job's
pieces as a rank does (configs/demo_rl.yaml, 8 prompts x 8 samples, <= 24 new tokens, T = 1, the
Megatron actor, the vLLM rollout) and then, per repeat (the order of the two sides alternating):

  rollout phase  what StepSampler._generate_here times as timing_s/generate: roles.generate ->
                 RolloutEngine.generate -> VLLMRollout (one request of n samples per prompt, seeds
                 per request, the sampled tokens' log-probs as flat lists, no detokenization), its
                 rows into a RolloutResult; around it, the prompts (the loader's next batch,
                 tokenized, broadcast), the lazy sync with its wakes (the weights marked stale, as
                 after every update) and the rows into the step's batch (batching.assemble)
  bare           vllm.LLM.generate on the same engine with the same prompts, n, sampling
                 parameters and seeds, built here; then the same with one of our choices
                 changed: vLLM's defaults (log-probs off, detokenized), detokenized, log-probs as
                 per-token dicts, no log-probs, and n requests of one sample (seeds s + j, vLLM's
                 own for the j-th sample of a request seeded s)
  vLLM alone     the same requests on a second engine, built as a user builds vllm.LLM for them:
                 float32 (vLLM's auto dtype is bfloat16 on a CPU with AVX-512 BF16), a 1 GiB KV
                 cache, vLLM's defaults otherwise; what the job's own engine arguments cost (its
                 auto-sized KV cache without vLLM's null block made the last of 64 sequences wait)

Every generate starts with vLLM's prefix cache reset, as the rollout phase's does after its weight
load. Printed: per part its median seconds (wall, and CPU of the process, which a busy machine
disturbs less) with the range over the repeats; the rollout phase / bare and / vLLM alone ratios
per repeat; whether the rollout's tokens equal the bare call's and vLLM alone's (the same seeds must
give the same tokens); the engine's start-up; with both modes, eager against compiled. The comparison is within one process and one engine, so the ratios hold on a
shared machine; compare eager with compiled by their CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_trl import SIZES, assets  # noqa: E402

SIZE = SIZES["135m"]
BARE = {  # variant: SamplingParams keywords on top of the rollout's own (bare_same)
    "bare_same": {},
    "vllm_defaults": dict(logprobs=None, flat_logprobs=False, detokenize=True),
    "detokenized": dict(detokenize=True),
    "logprob_dicts": dict(flat_logprobs=False),
    "no_logprobs": dict(logprobs=None, flat_logprobs=False),
    "n_requests": {},  # n requests of one sample each
    "vllm_alone": {},  # the same requests on an engine built with vLLM's defaults (worker)
}


def overrides(out: Path, model: Path, mode: str, threads: int):
    run = out / f"overhead_{mode}"
    return [f"model.path={model}", f"data.train_files=[{out}/data/train.parquet]",
            f"data.val_files=[{out}/data/val.parquet]", f"data.train_batch_size={SIZE.prompts}",
            f"actor.ppo_mini_batch_size={SIZE.prompts}", f"actor.micro_batch_size={SIZE.prompts * SIZE.n}",
            f"rollout.n={SIZE.n}", f"data.max_response_length={SIZE.new_tokens}", "trainer.val_every=0",
            f"trainer.output_dir={run}", f"slurm.log_dir={run}/logs", "trainer.resume=never",
            f"slurm.cpus_per_task={threads}", "rollout.engine=vllm",
            f"rollout.enforce_eager={'true' if mode == 'eager' else 'false'}", *SIZE.verl_set[1:]]


class Clock:
    """Wall and process-CPU seconds of a block, appended to a dict of lists."""
    def __init__(self, into: dict, name: str):
        self.into, self.name = into, name

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        self.into.setdefault(self.name, []).append((time.perf_counter() - self.wall, time.process_time() - self.cpu))


def worker(a) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import logging

    import torch

    from verl_hpc import runtime
    from verl_hpc.config import load_config, validate
    from verl_hpc.rollout.sampling import request_seed
    from verl_hpc.tracking.timers import StageTimer
    from verl_hpc.trainer.placement import choose
    from verl_hpc.trainer.programs.rl import RLTrainer
    from verl_hpc.trainer.roles import build_roles
    from verl_hpc.trainer.stages.batching import assemble, broadcast_prompts

    up = []

    class EngineUp(logging.Handler):  # VLLMRollout's "vLLM engine up in %.1f s" line
        def emit(self, record):
            if record.getMessage().startswith("vLLM engine up in"):
                up.append(record.args[0])

    logging.getLogger("verl_hpc.rollout.vllm.engine").addHandler(EngineUp())
    cfg = load_config(str(REPO / "configs/demo_rl.yaml"), overrides(Path(a.out), Path(a.model), a.mode, a.threads))
    validate(cfg, check_model=True)
    ctx = runtime.bootstrap(backend=cfg.parallel.backend, timeout_s=cfg.trainer.collective_timeout_s,
                            seed=cfg.trainer.seed, num_threads=cfg.slurm.cpus_per_task)
    roles = build_roles(cfg, ctx, with_rollout=True)
    times, same, samples = {}, [], []  # samples: each repeat's tokens and log-probs, compared across modes
    with roles.rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        trainer = RLTrainer(cfg, ctx, roles, choose(cfg, ctx))
        llm = roles.rollout.llm
        # vLLM alone: an engine of its own as a user builds it for these requests (float32 as the
        # rollout on CPU, whose auto dtype is bfloat16 here; a KV cache of 1 GiB, where vLLM's
        # default takes a share of the machine's memory), vLLM's defaults otherwise
        from vllm import LLM

        from verl_hpc.rollout.vllm import compat as vllm_compat

        with vllm_compat.engine_construction(torch.device("cpu"), tp=1):  # the process's threads and RNG kept
            alone = LLM(model=a.model, dtype="float32", max_model_len=llm.llm_engine.vllm_config.model_config.max_model_len,
                        max_num_seqs=SIZE.prompts * SIZE.n, enforce_eager=a.mode == "eager", seed=0,
                        kv_cache_memory_bytes=1 << 30)

        def bare(prompts, spec, variant):
            engine = alone if variant == "vllm_alone" else llm
            keys = dict(temperature=spec.temperature, top_p=spec.top_p, top_k=max(spec.top_k, 0),
                        max_tokens=spec.max_tokens, logprobs=0, flat_logprobs=True, detokenize=False)
            keys.update(BARE[variant])
            if variant == "n_requests":
                requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(spec.n)]
                params = [SamplingParams(n=1, seed=request_seed(spec.seed, i) + j, **keys)
                          for i in range(len(prompts)) for j in range(spec.n)]
            else:
                requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
                params = [SamplingParams(n=spec.n, seed=request_seed(spec.seed, i), **keys) for i in range(len(prompts))]
            engine.reset_prefix_cache()
            with Clock(times, variant):
                outs = engine.generate(requests, params, use_tqdm=False)
            return [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]

        def phase(step, prompts, spec, record):
            trainer.rollout_weights.mark_stale()  # as after every update: the lazy sync runs first
            timer = StageTimer()
            with Clock(times, "ready"):
                trainer.rollout_weights.ready(timer)
            with Clock(times, "rollout_phase"):
                with timer("generate"):  # StepSampler._generate_here's timed call
                    result = roles.generate(prompts, spec)
            with Clock(times, "assemble"):
                assemble(prompts, result, roles.tokenizer, roles.pad_id)
            for k, v in timer.pop().items():
                if k != "timing_s/step":
                    times.setdefault(k, []).append((v, float("nan")))
            record["rollout"] = result.response_ids
            samples.append(dict(ids=result.response_ids, logprobs=result.logprobs))

        for rep in range(a.repeats + 1):  # the first: warm-up, not recorded
            step = rep + 1
            with Clock(times, "prompts"):
                prompts = broadcast_prompts(trainer.loader, ctx)
            spec = trainer.sampler.sampling.for_step(step)
            record = {}
            order = ["phase", *BARE] if rep % 2 == 0 else [*reversed(BARE), "phase"]
            for side in order:
                if side == "phase":
                    phase(step, prompts, spec, record)
                else:
                    record[side] = bare(prompts.prompt_ids, spec, side)
            same.append({k: record[k] == record["rollout"] for k in ("bare_same", "n_requests", "vllm_defaults", "vllm_alone")})
            if rep == 0:
                times.clear()
                same.clear()
                samples.clear()
            print(f"[{a.mode}] repeat {rep}: rollout phase {times.get('rollout_phase', [(float('nan'),)])[-1][0]:.2f} s, "
                  f"bare {times.get('bare_same', [(float('nan'),)])[-1][0]:.2f} s", flush=True)
    runtime.shutdown(ctx)
    Path(a.result).write_text(json.dumps(dict(times=times, same=same, samples=samples, engine_up_s=up,
                                              load_end=os.getloadavg()[0])))


def _fmt(pairs, k):
    xs = [p[k] for p in pairs]
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


ROWS = [("prompts", "prompts: loader batch, tokenized, broadcast"), ("ready", "wake, lazy sync, wake (ready())"),
        ("timing_s/wake", "of which wake (weights)"), ("timing_s/sync", "of which the weight sync"),
        ("timing_s/wake_kv", "of which wake (KV cache)"), ("rollout_phase", "rollout phase (timing_s/generate)"),
        ("assemble", "rows into the step's batch"),
        ("bare_same", "bare LLM.generate, the same requests"), ("vllm_defaults", "bare, vLLM's defaults (no log-probs, text)"),
        ("detokenized", "bare, detokenized"), ("logprob_dicts", "bare, log-probs as per-token dicts"),
        ("no_logprobs", "bare, no log-probs"), ("n_requests", "bare, n requests of one sample"),
        ("vllm_alone", "vLLM alone: its own engine, vLLM's defaults (float32, KV 1 GiB), the same requests")]


def report(results: dict) -> None:
    modes = list(results)
    print("\nseconds, median (range) over the repeats; wall | CPU of the process")
    print("| part | " + " | ".join(f"{m} wall | {m} CPU" for m in modes) + " |")
    print("|---|" + "---|---|" * len(modes))
    for key, label in ROWS:
        cells = []
        for m in modes:
            pairs = results[m]["times"].get(key)
            cpu = pairs and all(p[1] == p[1] for p in pairs)  # the stage timer's rows are wall only
            cells += [_fmt(pairs, 0) if pairs else "-", _fmt(pairs, 1) if cpu else "-"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for m in modes:
        t = results[m]["times"]
        ratios = [g[0] / b[0] for g, b in zip(t["rollout_phase"], t["bare_same"])]
        cpu = [g[1] / b[1] for g, b in zip(t["rollout_phase"], t["bare_same"])]
        n_req = [n[1] / b[1] for n, b in zip(t["n_requests"], t["bare_same"])]
        alone = [g[1] / v[1] for g, v in zip(t["rollout_phase"], t["vllm_alone"])] if "vllm_alone" in t else [float("nan")]
        same = results[m]["same"]
        print(f"{m}: rollout phase / bare generate = {statistics.median(ratios):.3f}x wall "
              f"({min(ratios):.3f}-{max(ratios):.3f}), {statistics.median(cpu):.3f}x CPU ({min(cpu):.3f}-{max(cpu):.3f}); "
              f"rollout phase / vLLM alone {statistics.median(alone):.3f}x CPU ({min(alone):.3f}-{max(alone):.3f}); "
              f"n requests / one request of n: {statistics.median(n_req):.3f}x CPU; engine up in "
              f"{results[m]['engine_up_s'][0]:.1f} s; same tokens as bare: {all(s['bare_same'] for s in same)}, "
              f"as n requests: {all(s['n_requests'] for s in same)}, as vLLM's defaults: "
              f"{all(s['vllm_defaults'] for s in same)}, as vLLM alone: {all(s.get('vllm_alone') for s in same)}; "
              f"load at the end {results[m]['load_end']:.1f}")


def compare_modes(a: dict, b: dict) -> str:
    """Two modes' samples of the same requests (the same prompts and seeds in each repeat): the share
    of responses with the same tokens and, over the positions before a response's first different
    token, the largest log-prob difference."""
    rows = same_rows = 0
    worst = 0.0
    for ra, rb in zip(a["samples"], b["samples"]):
        for ia, ib, la, lb in zip(ra["ids"], rb["ids"], ra["logprobs"], rb["logprobs"]):
            rows += 1
            same_rows += ia == ib
            k = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
            worst = max([worst, *(abs(x - y) for x, y in zip(la[:k], lb[:k]))])
    return (f"{same_rows} of {rows} responses token for token the same; largest log-prob difference "
            f"before a response's first different token {worst:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/bench_vs_trl", help="model, data and runs (shared with bench_vs_trl.py)")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (slurm.cpus_per_task); 1 is steadier "
                                                          "on a machine shared with other jobs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("load average at start: %.1f %.1f %.1f on %d CPUs" % (*os.getloadavg(), os.cpu_count()))
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = assets(out, SIZE, 0)
    results = {}
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        result = out / f"overhead_{mode}.json"
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--out", str(out), "--model", str(model),
               "--repeats", str(a.repeats), "--threads", str(a.threads), "--result", str(result)]
        log = out / f"overhead_{mode}.log"
        print(f"[bench] {mode}: {shlex.join(cmd)} (log {log})", flush=True)
        with open(log, "w") as f:
            rc = subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            sys.exit(f"bench_rollout_overhead: the {mode} run failed (exit {rc}); log: {log}")
        results[mode] = json.loads(result.read_text())
    report(results)
    if {"eager", "compiled"} <= set(results):
        print("eager vs compiled, the same requests: " + compare_modes(results["eager"], results["compiled"]))
    (out / "overhead_summary.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
