"""`python -m verl_hpc.gpu_check`: see verl_hpc/gpu_check/__init__.py."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

STATUS_ORDER = ("PASS", "FAIL", "NOT TESTABLE", "SKIPPED")


def table(rows) -> str:
    width = max([len(c.name) for c, *_ in rows] + [5])
    lines = [f"{'check':<{width}}  {'status':<12}  {'s':>6}  detail", "-" * (width + 80)]
    lines += [f"{c.name:<{width}}  {st:<12}  {sec:6.1f}  {detail}" for c, st, detail, sec in rows]
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


def write_rows(out: Path, rows) -> None:
    """OUT/gpu_check.json, rewritten after each check: make gpu-all's summary lists the failures from it."""
    (out / "gpu_check.json").write_text(json.dumps({"rows": [
        {"check": c.name, "status": st, "detail": detail, "seconds": round(sec, 1)} for c, st, detail, sec in rows]},
        indent=1) + "\n")


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
    args = ap.parse_args(argv)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        ap.error(f"--out '{args.out}' is a file; valid: a work folder (created when missing)")
    if args.dry_run:
        print(dry_run(CHECKS))
        return 0
    # Bitwise resume needs deterministic kernels; set before CUDA is initialised.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    import torch

    from verl_hpc.gpu_check.kit import Kit, run_checks
    from verl_hpc.gpu_check.preflight import environment_line, version_warnings
    from verl_hpc.runtime.device import has_gpu

    if not args.cpu_rehearsal and not has_gpu():
        print("gpu_check: no CUDA device here. Use --dry-run "
              "to list the checks, or --cpu-rehearsal to test the kit itself on CPU.", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = args.out or Path(tempfile.mkdtemp(prefix="verl_hpc_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    kit = Kit(out=out, rehearsal=args.cpu_rehearsal)
    env = environment_line()
    print(env)  # before the checks too: a version that differs is the first suspect of a failure
    rows = run_checks(kit, CHECKS, args.only, on_row=lambda rows: write_rows(out, rows))
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
    return 1 if any(st == "FAIL" for _, st, *_ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
