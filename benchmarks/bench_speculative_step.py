"""The whole RL step with and without speculative decoding (rollout.speculative): a few GRPO steps of
the tool demo's RL phase, same seeds, each side a job of its own; the rollout phase's and the whole
step's seconds from the job's own timers (timing_s/generate, timing_s/step in metrics.jsonl).

    make demo-tool                                      # once: the warm start outputs/demo_tool/sft/hf
    python benchmarks/bench_speculative_step.py         # tiny model, off vs ngram, 4 steps
    python benchmarks/bench_speculative_step.py --widen --methods off,auto --steps 8 \
        --set data.train_batch_size=4 rollout.n=4 actor.ppo_mini_batch_size=4 actor.micro_batch_size=16

The job: configs/demo_tool.yaml (GRPO over multi-turn episodes: a model turn, the calculator's turn,
a model turn that copies the tool's output; 16 prompts x 8 samples, up to 100 tokens a turn) from the
demo's warm start, validation off, rollout.engine = vllm. A step's rollout runs the batch's first
turns together and then, as episodes end at different lengths, a falling number of sequences: the
tail is in the figure. --widen: the warm start's function in the 102M Llama's layer stack (90M
parameters, benchmarks/bench_speculative.py's `widen`: same tokens, a 90M model's compute per token).

Per side: the median over the steps after the first (the first builds and warms the engines) of
timing_s/generate and timing_s/step, the mean response length, and rollout/spec_acceptance. Speculation
is lossless but consumes the sampler's random numbers differently, so the sides sample different
(equally likely) episodes: compare seconds per response token as well as seconds. On a shared
machine, compare the ratios of one run only.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_side(method: str, model: Path, data: Path, out: Path, a) -> dict:
    """One GRPO job with rollout.speculative.method = `method`; its per-step figures."""
    if method in a.runs:  # a job that ran already (e.g. the demo's own RL phase): its figures only
        return figures(method, Path(a.runs[method]), None, a)
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_tool.yaml", "--local", f"model.path={model}",
           f"data.train_files=[{data}/train.parquet]", f"data.val_files=[{data}/val.parquet]",
           f"trainer.output_dir={out}", f"trainer.total_steps={a.steps}", "trainer.val_every=0",
           "rollout.engine=vllm", f"rollout.speculative.method={method}", *a.set]
    print(f"  {method}: {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{method} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return figures(method, out, wall, a)


def figures(method: str, out: Path, wall, a) -> dict:
    """Medians over the steps after the first of a job's metrics.jsonl (at most --steps steps)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "timing_s/step" in r][1:a.steps]  # the first step warms the engines up
    if not steps:
        raise SystemExit(f"{method}: no step after the first in {out}/metrics.jsonl (use --steps >= 2)")
    med = lambda k: statistics.median(r[k] for r in steps)  # noqa: E731
    tokens = statistics.mean(r["rollout/response_tokens"] for r in steps)
    acc = [r["rollout/spec_acceptance"] for r in steps if "rollout/spec_acceptance" in r]
    return dict(generate=med("timing_s/generate"), step=med("timing_s/step"), tokens=tokens,
                length=statistics.mean(r["rollout/response_length_mean"] for r in steps),
                acceptance=statistics.mean(acc) if acc else None, wall=wall, steps=len(steps))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="outputs/demo_tool/sft/hf", help="the tool demo's warm start")
    ap.add_argument("--data", default="outputs/demo_tool/data", help="the tool demo's data folder")
    ap.add_argument("--methods", default="off,ngram", help="comma list of rollout.speculative.method values; "
                                                          "the first is the baseline")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps per side (the first is not counted)")
    ap.add_argument("--widen", action="store_true", help="the warm start in the 102M stack (90M parameters)")
    ap.add_argument("--work", default="/tmp/bench_speculative_step", help="the jobs' output folders")
    ap.add_argument("--set", nargs="*", default=[], help="further dotted overrides for both sides")
    ap.add_argument("--runs", nargs="*", default=[], metavar="METHOD=DIR",
                    help="read these methods' figures from jobs that ran already (their output_dir) instead of "
                         "running them, e.g. the demo's RL phase run with and without speculation")
    a = ap.parse_args(argv)
    a.runs = dict(r.split("=", 1) for r in a.runs)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("load average at start: %.1f %.1f %.1f on %d CPUs" % (*os.getloadavg(), os.cpu_count()), flush=True)
    work, model = Path(a.work), Path(a.model).resolve()
    if not (model / "config.json").exists() and len(a.runs) < len(a.methods.split(",")):
        raise SystemExit(f"--model {model}: no config.json (run `make demo-tool` first)")
    if a.widen:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_speculative import widen

        model = widen(model, work / "wide_model")
    got = {}
    for method in a.methods.split(","):
        got[method] = run_side(method, model, Path(a.data).resolve(), work / method, a)
    base = got[a.methods.split(",")[0]]
    counted = min(r["steps"] for r in got.values())
    print(f"\n{'model: 90M (widened)' if a.widen else 'model: tiny'}; medians of steps 2..{counted + 1}")
    print("| method | generate s | step s | response tokens | generate ratio | step ratio | "
          "s per token ratio (generate) | acceptance |")
    print("|---|---|---|---|---|---|---|---|")
    for method, r in got.items():
        per_token = (r["generate"] / r["tokens"]) / (base["generate"] / base["tokens"])
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"| {method} | {r['generate']:.1f} | {r['step']:.1f} | {r['tokens']:.0f} | "
              f"{base['generate'] / r['generate']:.2f} | {base['step'] / r['step']:.2f} | {1 / per_token:.2f} | {acc} |")
    walls = [f"{m} {r['wall']:.0f} s" for m, r in got.items() if r["wall"] is not None]
    if walls:
        print("wall per side (the jobs' start and validation included): " + ", ".join(walls))
    print("load average at end: %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    main()
