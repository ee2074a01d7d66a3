"""`bench_async.py measure`: colocated-synchronous against split-asynchronous RL, measured on this
machine's cores.

    python benchmarks/bench_async.py measure                  # both workloads: tiny 2 rounds of the 3 layouts, 100m 1
    python benchmarks/bench_async.py measure --quick          # a smoke run: fewer steps, a smaller 100m batch
    python benchmarks/bench_async.py measure --workloads 100m --steps 6 --repeats 1

Three layouts of the same job (`python -m verl_hpc.submit configs/demo_rl.yaml --local`, vLLM
rollout; the same batch, n, response length, steps, learning rate and seeds) on the same cores:
- colocated_1x2: 1 rank with 2 torch threads (slurm.cpus_per_task sets a rank's threads);
- colocated_2x1: 2 ranks x 1 thread, data-parallel;
- split: 1 rollout rank (vLLM only) + 1 training rank (Megatron only) at staleness k (default 1).
The best colocated layout is the faster of the first two, per workload and figure.

Workloads (the models and data of bench_vs_trl.py, built once under --out and reused):
- tiny: the 0.4M Llama after the SFT warm start; the training time (timing_s/step summed, validation
  excluded) until greedy validation accuracy first reaches the start + --gain points, and the wall
  time between the two metrics rows (validation included);
- 100m: the 102M Llama, random init, a speed figure: samples/s = samples trained / seconds over
  the steps after --warmup (start-up and the first step left out). Zero-advantage rows are not
  skipped here: with random weights every reward is 0 and the update would do nearly nothing.
Ratios: split / best colocated training time to the gain (goal <= 0.7) and split / best colocated
samples/s (goal >= 1.4). With R repeats (--repeats; tiny 2, 100m 1) each layout runs R times, the
order rotated each round so that the machine's load falls on all of them; medians.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .common import ROOT

GOAL_TIME = 0.7  # split / best colocated time to the gain, at most
GOAL_THROUGHPUT = 1.4  # split / best colocated samples/s, at least
PROGRESS_EVERY_S = 5.0


class JobFailed(Exception):
    """A measured job ended with an error: its exit code and the line that says why."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    size: str  # the model of bench_vs_trl.SIZES
    prompts: int
    n: int
    max_tokens: int
    steps: int
    lr: float
    val_every: int  # 0: no validation (a speed figure)
    repeats: int  # rounds of the layouts: the tiny jobs are cheap, a 100m job costs minutes
    extra: tuple = ()


WORKLOADS = {
    # lr 1e-4 (not the 1e-3 of bench_vs_trl): at 1e-3 the gain comes in 2 steps, too few to time
    "tiny": Workload("tiny", "Llama 0.4M, SFT warm start", "tiny", prompts=16, n=8, max_tokens=8, steps=20,
                     lr=1e-4, val_every=2, repeats=2),
    "100m": Workload("100m", "Llama 102M, random init", "100m", prompts=8, n=8, max_tokens=24, steps=4, lr=1e-5,
                     val_every=0, repeats=1, extra=("rollout.kv_cache_memory_bytes=268435456",
                                         "actor.skip_zero_advantage_rows=false")),
}
QUICK = {"tiny": dict(steps=10, repeats=1), "100m": dict(steps=3, prompts=4)}
QUICK_GAIN = 10.0


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    title: str
    ranks: int
    threads: int  # torch threads per rank
    split: bool

    @property
    def train_ranks(self) -> int:
        return self.ranks - 1 if self.split else self.ranks


LAYOUTS = {x.name: x for x in (
    Layout("colocated_1x2", "colocated, 1 rank x 2 threads", 1, 2, False),
    Layout("colocated_2x1", "colocated, 2 ranks x 1 thread", 2, 1, False),
    Layout("split", "split, 1 rollout + 1 training rank", 2, 1, True),
)}


# ----------------------------------------------------------------------------------- the jobs
def workloads(args) -> List[Workload]:
    """The chosen workloads with --quick and the flags applied."""
    out = []
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        w = dataclasses.replace(w, **QUICK[name]) if args.quick else w
        flags = dict(steps=args.steps, prompts=args.batch, n=args.n, max_tokens=args.max_tokens,
                     val_every=args.val_every if w.val_every else None, repeats=args.repeats)
        out.append(dataclasses.replace(w, **{k: v for k, v in flags.items() if v is not None}))
    return out


def overrides(w: Workload, layout: Layout, args, model: Path, data: Path, run: Path) -> List[str]:
    """The job's command-line overrides: the workload's, then the layout's, then --set."""
    over = [f"model.path={model}", f"data.train_files=[{data}/train.parquet]",
            f"data.val_files=[{data}/val.parquet]", f"data.train_batch_size={w.prompts}",
            f"actor.ppo_mini_batch_size={w.prompts}", f"actor.micro_batch_size={w.prompts * w.n // layout.train_ranks}",
            f"rollout.n={w.n}", f"data.max_response_length={w.max_tokens}", f"actor.optim.lr={w.lr}",
            "actor.optim.lr_decay_style=constant", "actor.optim.min_lr=0", f"trainer.total_steps={w.steps}",
            f"trainer.val_every={w.val_every}", "tracking.backends=[jsonl]", "tracking.plots=false", "trainer.resume=never",
            "checkpoint.save_every=0", "checkpoint.keep_last=1", "rollout.engine=vllm",
            f"trainer.output_dir={run}", f"slurm.log_dir={run}/logs", *w.extra,
            f"slurm.tasks_per_node={layout.ranks}", f"slurm.cpus_per_task={layout.threads}"]
    if args.seed is not None:
        over += [f"trainer.seed={args.seed}", f"data.seed={args.seed}", f"rollout.seed={args.seed}"]
    if layout.split:
        over += ["placement.mode=split", f"placement.rollout_ranks={layout.ranks - layout.train_ranks}",
                 f"async_training.staleness={args.staleness}"]
    return over + list(args.set)


def check_jobs(jobs) -> None:
    """Every job's config through the config's own checks, before anything runs."""
    from verl_hpc.config import ConfigError, load_config, validate

    for w, layout, over in jobs:
        try:
            validate(load_config(ROOT / "configs" / "demo_rl.yaml", over), check_model=False)
        except ConfigError as err:
            raise ConfigError(f"measure, {w.name} / {layout.name}: {err}") from None


def _env() -> dict:
    """This tree's verl_hpc for the job and its ranks, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def last_error(log: Path) -> str:
    """The job's `error: ...` line, or its last line."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if "error: " in x]
    return (errors or lines or ["(no output)"])[-1][:300]


def run_job(cmd: List[str], run: Path, log: Path, label: str, steps: int, timeout_s: float) -> None:
    """One job; progress lines while it runs; JobFailed if it fails or outlives timeout_s."""
    progress = Progress(label, steps)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)  # its own group: a timeout ends it and its ranks
        t0 = time.monotonic()
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
                raise JobFailed(f"measure: {label} ran past --job-timeout {timeout_s:g} s; log: {log}", 124)
            progress.update(read_rows(run / "metrics.jsonl"))
            time.sleep(1.0)
    if proc.returncode:
        raise JobFailed(f"measure: {label} failed (exit {proc.returncode}): {last_error(log)}; log: {log}",
                        proc.returncode)
    progress.update(read_rows(run / "metrics.jsonl"), final=True)


class Progress:
    """`[measure] label: step s/N, x s/step, ETA` at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, label: str, steps: int):
        self.label, self.steps, self.shown, self.at = label, steps, 0, 0.0

    def update(self, rows: List[dict], final: bool = False) -> None:
        """final: the job has ended; its last step is shown whenever the last line was."""
        done = step_rows(rows)
        now = time.monotonic()
        if not done or len(done) == self.shown or (not final and now - self.at < PROGRESS_EVERY_S):
            return
        spent = [r["timing_s/step"] + r.get("timing_s/validation", 0.0) for r in done]
        left = (self.steps - len(done)) * statistics.median(spent)
        print(f"[measure]   {self.label}: step {len(done)}/{self.steps}, {statistics.median(spent):.2f} s/step"
              + (f", ETA {left:.0f} s" if left > 0 else ", done"), flush=True)
        self.shown, self.at = len(done), now


# ----------------------------------------------------------------------------------- the figures
def read_rows(path: Path) -> List[dict]:
    """metrics.jsonl's rows; a last line still being written is left out."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def step_rows(rows: List[dict]) -> List[dict]:
    return sorted((r for r in rows if "timing_s/step" in r), key=lambda r: r["step"])


def time_to_gain(rows: List[dict], gain_points: float) -> Optional[dict]:
    """The first validation at >= the start's accuracy + gain_points: its step, the training time
    until then (timing_s/step of steps 1..step; validation excluded) and the wall time between
    the step-0 row and its row (validation included). None if never reached or no validation."""
    val = {r["step"]: r for r in rows if "val/acc/all" in r}
    if 0 not in val:
        return None
    start = val[0]["val/acc/all"]
    for step in sorted(s for s in val if s > 0):
        if 100 * (val[step]["val/acc/all"] - start) >= gain_points - 1e-9:
            train = sum(r["timing_s/step"] for r in step_rows(rows) if r["step"] <= step)
            return dict(step=step, seconds=train, wall_s=val[step]["time"] - val[0]["time"], start=start,
                        reached=val[step]["val/acc/all"])
    return None


def summarize(rows: List[dict], warmup: int, gain_points: float) -> dict:
    """One job's figures from its metrics rows: over the steps after `warmup`, s/step (median),
    samples/s (samples / seconds), the split's idle fractions (means); the time to the gain."""
    steps = step_rows(rows)
    window = [r for r in steps if r["step"] > warmup]
    if not window:
        raise JobFailed(f"measure: no step after --warmup {warmup} in the metrics ({len(steps)} steps)", 2)
    seconds = sum(r["timing_s/step"] for r in window)
    out = dict(steps=len(steps), s_per_step=statistics.median(r["timing_s/step"] for r in window),
               samples_per_s=sum(r["train/samples"] for r in window) / seconds,
               gain=time_to_gain(rows, gain_points), val_last=next(
                   (r["val/acc/all"] for r in reversed(rows) if "val/acc/all" in r), None))
    for key in ("async/idle_frac/train", "async/idle_frac/rollout", "async/staleness_max"):
        vals = [r[key] for r in window if key in r]
        if vals:
            out[key] = max(vals) if key.endswith("_max") else statistics.fmean(vals)
    return out


def median_of(runs: List[dict]) -> dict:
    """The repeats of one layout: medians; the time to the gain only if every repeat reached it."""
    gains = [r["gain"] for r in runs]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]
           if isinstance(runs[0][k], (int, float)) and all(r.get(k) is not None for r in runs)}
    out["gain"] = None if None in gains else {k: statistics.median(g[k] for g in gains) for k in gains[0]}
    out["runs"] = len(runs)
    return out


def compare(layouts: Dict[str, dict]) -> dict:
    """Split against the best colocated layout: by time to the gain (lowest) and samples/s (highest)."""
    colo = {k: v for k, v in layouts.items() if not LAYOUTS[k].split}
    split = layouts["split"]
    out = {}
    timed = {k: v["gain"]["seconds"] for k, v in colo.items() if v.get("gain")}
    if timed and split.get("gain"):
        best = min(timed, key=timed.get)
        ratio = split["gain"]["seconds"] / timed[best]
        out["time_to_gain"] = dict(best_colocated=best, ratio=ratio, goal=GOAL_TIME, met=ratio <= GOAL_TIME)
    rates = {k: v["samples_per_s"] for k, v in colo.items()}
    best = max(rates, key=rates.get)
    ratio = split["samples_per_s"] / rates[best]
    out["samples_per_s"] = dict(best_colocated=best, ratio=ratio, goal=GOAL_THROUGHPUT, met=ratio >= GOAL_THROUGHPUT)
    return out


# ----------------------------------------------------------------------------------- the run
def order(names: List[str], round_: int) -> List[str]:
    """Round r starts at layout r: each layout takes each place in the order once per len rounds."""
    k = round_ % len(names)
    return names[k:] + names[:k]


def load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def measure_workload(w: Workload, args, out: Path, jobs_total: List[int]) -> dict:
    import bench_vs_trl  # the same models, data and warm start as the TRL comparison

    model = bench_vs_trl.assets(out, bench_vs_trl.SIZES[w.size], args.sft_steps)
    names = args.layouts.split(",")
    runs: Dict[str, List[dict]] = {name: [] for name in names}
    for r in range(w.repeats):
        for name in order(names, r):
            layout = LAYOUTS[name]
            run = out / f"{w.name}_{name}_r{r + 1}"
            cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--local",
                   *overrides(w, layout, args, model, out / "data", run)]
            jobs_total[0] += 1
            label, load_start = f"{w.name} / {name} (round {r + 1})", load()
            print(f"[measure] job {jobs_total[0]}/{jobs_total[1]}: {label}: {layout.title}, load average "
                  f"{load_start:.1f}; log {run}.log", flush=True)
            shutil.rmtree(run, ignore_errors=True)  # a fresh run: no earlier run's checkpoint resumed
            t0 = time.monotonic()
            run_job(cmd, run, Path(f"{run}.log"), label, w.steps, args.job_timeout)
            fig = summarize(read_rows(run / "metrics.jsonl"), args.warmup, args.gain)
            fig.update(job_s=time.monotonic() - t0, load_start=load_start, load_end=load(), command=" ".join(cmd))
            runs[name].append(fig)
    layouts = {name: median_of(v) for name, v in runs.items()}
    return dict(workload=dataclasses.asdict(w), layouts=layouts, runs=runs, compare=compare(layouts))


def print_workload(res: dict, args) -> None:
    w, layouts = res["workload"], res["layouts"]
    print(f"\n{w['name']}: {w['title']}, {w['prompts']} prompts x {w['n']}, <= {w['max_tokens']} new tokens, "
          f"{w['steps']} steps, vLLM; medians of {w['repeats']} run(s), steps after {args.warmup}")
    print(f"{'layout':<38} {'s/step':>7} {'samples/s':>10} {'time to +' + format(args.gain, 'g') + ' pts':>16} "
          f"{'wall incl. val':>15} {'idle train/rollout':>19}")
    for name, v in layouts.items():
        g = v.get("gain")
        gain = f"{g['seconds']:.2f} s (st {g['step']:.0f})" if g else ("no validation" if not w["val_every"]
                                                                     else "not reached")
        wall = f"{g['wall_s']:.2f} s" if g else "-"
        idle = (f"{v['async/idle_frac/train']:.0%} / {v['async/idle_frac/rollout']:.0%}"
                if "async/idle_frac/train" in v else "-")
        print(f"{LAYOUTS[name].title + (' k=' + str(args.staleness) if LAYOUTS[name].split else ''):<38} "
              f"{v['s_per_step']:>7.3f} {v['samples_per_s']:>10.2f} {gain:>16} {wall:>15} {idle:>19}")
    for key, what, sign in (("time_to_gain", "training time to the gain", "<="), ("samples_per_s", "samples/s", ">=")):
        c = res["compare"].get(key)
        if c:
            print(f"split / best colocated ({c['best_colocated']}), {what}: {c['ratio']:.2f}x "
                  f"(goal {sign} {c['goal']}: {'met' if c['met'] else 'not met'})")
        elif key == "time_to_gain" and w["val_every"]:
            print(f"{what}: no ratio (the split or every colocated layout did not reach +{args.gain:g} points)")


def run_measure(args) -> int:
    check_args(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ws = workloads(args)
    names = args.layouts.split(",")
    check_jobs([(w, LAYOUTS[n], overrides(w, LAYOUTS[n], args, out / "model", out / "data", out / "run"))
                for w in ws for n in names])
    jobs = [0, sum(w.repeats for w in ws) * len(names)]
    print(f"[measure] {os.cpu_count()} CPUs, load average {load():.1f}; {jobs[1]} jobs under {out}", flush=True)
    results = dict(command=" ".join(["python", "benchmarks/bench_async.py", *args.argv]), cpus=os.cpu_count(),
                   gain_points=args.gain, warmup=args.warmup, staleness=args.staleness, load_start=load(), workloads={})
    try:
        for w in ws:
            results["workloads"][w.name] = res = measure_workload(w, args, out, jobs)
            print_workload(res, args)
    except JobFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    results["load_end"] = load()
    path = Path(args.json) if args.json else out / "measure.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n[measure] load average {results['load_start']:.1f} at the start, {results['load_end']:.1f} at the end; "
          f"results: {path}")
    return 0


def check_args(args) -> None:
    from verl_hpc.config import ConfigError
    from verl_hpc.config.sections.placement import MAX_STALENESS

    bad_w = [x for x in args.workloads.split(",") if x not in WORKLOADS]
    names = args.layouts.split(",")
    bad_l = [x for x in names if x not in LAYOUTS]
    steps = [args.steps] if args.steps else [dataclasses.replace(WORKLOADS[x], **(QUICK[x] if args.quick else {})).steps
                                             for x in args.workloads.split(",") if x in WORKLOADS]
    checks = [
        (not bad_w, "--workloads", args.workloads, f"a comma list of {', '.join(WORKLOADS)}"),
        (not bad_l and len(set(names)) == len(names) and "split" in names and any(not LAYOUTS[x].split for x in names),
         "--layouts", args.layouts, f"split and at least one colocated layout of {', '.join(LAYOUTS)}, each once"),
        (args.repeats is None or args.repeats >= 1, "--repeats", args.repeats, ">= 1"),
        (args.warmup >= 0 and all(args.warmup < s for s in steps), "--warmup", args.warmup,
         f"0 .. the steps - 1 ({min(steps, default=1) - 1})"),
        (0 <= args.staleness <= MAX_STALENESS, "--staleness", args.staleness, f"[0, {MAX_STALENESS}]"),
        (args.gain > 0, "--gain", args.gain, "> 0 (accuracy points)"),
        (args.job_timeout > 0, "--job-timeout", args.job_timeout, "> 0 seconds"),
    ]
    for ok, flag, value, valid in checks:
        if not ok:
            raise ConfigError(f"{flag} {value}: valid: {valid}")


def add_measure(sub) -> None:
    p = sub.add_parser("measure", help="real jobs on this machine: colocated-sync vs split-async, same cores")
    p.add_argument("--workloads", default="tiny,100m", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of layouts (split and >= 1 colocated)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: tiny 10 steps (gain {QUICK_GAIN:g} points), 100m 3 steps of 4 prompts")
    p.add_argument("--steps", type=int, default=None, help="RL steps per job (default: tiny 20, 100m 4)")
    p.add_argument("--batch", type=int, default=None, help="data.train_batch_size (default: tiny 16, 100m 8)")
    p.add_argument("--n", type=int, default=None, help="rollout.n (default 8)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="data.max_response_length (default: tiny 8, 100m 24)")
    p.add_argument("--val-every", type=int, default=None, help="tiny's trainer.val_every (default 2)")
    p.add_argument("--gain", type=float, default=None,
                   help="validation accuracy points over the start for the time to gain (default 30)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of s/step and samples/s")
    p.add_argument("--staleness", type=int, default=1, help="the split's async_training.staleness k")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of all layouts, the order rotated each round (default: tiny 2, 100m 1; --quick 1)")
    p.add_argument("--seed", type=int, default=None, help="trainer, data and rollout seed (default: the config's)")
    p.add_argument("--sft-steps", type=int, default=600, help="the tiny model's SFT warm start (built once)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra override for every job (repeatable)")
    p.add_argument("--job-timeout", type=float, default=1200.0, help="seconds before a job is stopped as hung")
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_async"), help="models, data, runs and logs")
    p.add_argument("--json", default=None, help="the results file (default: OUT/measure.json)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if args.gain is None:
        args.gain = QUICK_GAIN if args.quick else 30.0
    return run_measure(args)
