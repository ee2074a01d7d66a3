"""`python -m verl_hpc.gpu_check`: see verl_hpc/gpu_check/__init__.py."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

STATUS_ORDER = ("PASS", "FAIL", "TIMEOUT", "NOT TESTABLE", "SKIPPED")
REHEARSAL_BUDGETS = 4  # a CPU rehearsal's check budgets: this many times the GPU's


def table(rows) -> str:
    width = max([len(c.name) for c, *_ in rows] + [5])
    budget = lambda c: f"{c.budget_s:6.0f}" if c.budget_s is not None else f"{'-':>6}"
    lines = [f"{'check':<{width}}  {'status':<12}  {'s':>6}  {'budget':>6}  detail", "-" * (width + 88)]
    lines += [f"{c.name:<{width}}  {st:<12}  {sec:6.1f}  {budget(c)}  {detail}" for c, st, detail, sec in rows]
    counts = {s: sum(1 for _, st, *_ in rows if st == s) for s in STATUS_ORDER}
    lines.append(", ".join(f"{n} {s.lower()}" for s, n in counts.items()))
    return "\n".join(lines)


def dry_run(checks) -> str:
    """Each check, what the machine needs for it, and which checks must pass first."""
    from verl_hpc.gpu_check.preflight import version_warnings

    width = max(len(c.name) for c in checks)
    lines = ["checks (in order; each runs only if those after 'after:' passed):",
             f"  {'check':<{width}}  {'machine needs':<40}  what"]
    for c in checks:
        after = f"  [after: {', '.join(c.needs)}]" if c.needs else ""
        lines.append(f"  {c.name:<{width}}  {c.machine:<40}  {c.what}{after}")
    lines += [f"WARNING: not the verified versions: {w}" for w in version_warnings()]
    return "\n".join(lines)


def needs_deterministic(set_name: str) -> bool:
    """Torch's deterministic mode, which the first-GPU set's bitwise resume check needs. Not for the
    vLLM set: that mode fills every torch.empty and takes deterministic fallbacks inside vLLM too,
    so its tokens/s and sleep figures would not be a job's (a job does not set it)."""
    return set_name != "vllm"


def check_set(name: str):
    """The checks of one set: "all" (checks.CHECKS) or "vllm" (vllm_checks: the in-process vLLM
    engine beside the training engines, its sleep levels, the weight sync, speculation, speed:
    vllm_set.py)."""
    if name == "vllm":
        from verl_hpc.gpu_check.vllm_set import checks

        return checks()
    from verl_hpc.gpu_check.checks import CHECKS

    return CHECKS


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--set", choices=("all", "vllm"), default="all")
    CHECKS = check_set(pre.parse_known_args(argv)[0].set)

    ap = argparse.ArgumentParser(prog="python -m verl_hpc.gpu_check",
                                 description="Run every GPU path one GPU can exercise; print a table.")
    ap.add_argument("--set", choices=("all", "vllm"), default="all",
                    help="all: the first-GPU checks; vllm: the vLLM checks (make gpu-all's vllm step)")
    ap.add_argument("--dry-run", action="store_true", help="list the checks and what each needs; exit 0 (any machine)")
    ap.add_argument("--out", type=Path, help="work folder (model, checkpoints); default: a temp folder")
    ap.add_argument("--only", nargs="*", choices=[c.name for c in CHECKS], help="run these checks only")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run the same checks on CPU with gloo and float32 (tests the kit; no GPU result)")
    ap.add_argument("--time-limit", type=float, help="seconds for the whole run: each check within its own "
                                                     "budget and what is left; the checks past it are SKIPPED")
    ap.add_argument("--continue", dest="resume", action="store_true",
                    help="continue the run killed at its limit in --out: the check it was running is TIMEOUT, "
                         "the ones it did not reach run now (make gpu-all does this after such a kill)")
    args = ap.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        ap.error(f"--time-limit {args.time_limit:g}; valid: seconds, more than 0")
    if args.resume and args.out is None:
        ap.error("--continue needs --out: the folder of the run to continue")
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        ap.error(f"--out '{args.out}' is a file; valid: a work folder (created when missing)")
    if args.dry_run:
        print(dry_run(CHECKS))
        return 0
    deterministic = needs_deterministic(args.set)
    if deterministic:  # bitwise resume needs deterministic kernels; set before CUDA is initialised
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    import torch

    from verl_hpc.gpu_check.kit import Kit, run_checks
    from verl_hpc.gpu_check.table import TableFile, continuation
    from verl_hpc.gpu_check.preflight import environment_line, version_warnings
    from verl_hpc.runtime.device import has_gpu

    if not args.cpu_rehearsal and not has_gpu():
        print("gpu_check: no CUDA device here. Use --dry-run "
              "to list the checks, or --cpu-rehearsal to test the kit itself on CPU.", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    out = args.out or Path(tempfile.mkdtemp(prefix="verl_hpc_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    kit = Kit(out=out, rehearsal=args.cpu_rehearsal)
    if kit.rehearsal:  # the budgets are a GPU's: 2 CPU cores build and run the same engines slower
        CHECKS = [dataclasses.replace(c, budget_s=c.budget_s * REHEARSAL_BUDGETS) if c.budget_s else c for c in CHECKS]
    env = environment_line()
    print(env)  # before the checks too: a version that differs is the first suspect of a failure
    only = args.only or None  # `--only` with no names: every check, as before
    planned, prior = [c.name for c in CHECKS if only is None or c.name in only], []
    if args.resume:
        try:
            prior, only, planned = continuation(out, CHECKS)
        except ValueError as e:
            ap.error(str(e))
    table_file = TableFile(out, planned, prior)
    run_checks(kit, CHECKS, only, deadline=deadline, on_start=table_file.started, on_row=table_file.done)
    by_name = {c.name: c for c in CHECKS}
    rows = [(by_name[r["check"]], r["status"], r["detail"], r["seconds"]) for r in table_file.merged()]
    warnings = version_warnings()
    text = "\n".join(filter(None, [
        env, "CPU REHEARSAL: not GPU results" if kit.rehearsal else "", table(rows),
        f"(ran with versions that differ from the verified ones: {'; '.join(warnings)})" if warnings else ""]))
    print(text)
    (out / "gpu_check.txt").write_text(text + "\n")

    print(f"(table and tracebacks of failed checks in {out})")
    try:
        from verl_hpc.runtime.bootstrap import shutdown

        shutdown()
    except Exception:
        pass
    return 1 if any(st in ("FAIL", "TIMEOUT") for _, st, *_ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
