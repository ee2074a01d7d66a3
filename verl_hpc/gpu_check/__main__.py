"""`python -m verl_hpc.gpu_check`: see verl_hpc/gpu_check/__init__.py."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

STATUS_ORDER = ("PASS", "FAIL", "NOT TESTABLE", "SKIPPED")


def load_memory_plan(spec: Optional[str]) -> Optional[Callable[[str, dict], Optional[float]]]:
    """The memory plan to compare peaks with: `module:function(component, facts) -> bytes or None`.
    Without --memory-plan, `verl_hpc.planning.gpu_check_budget` is used when the planning package
    provides it (it is optional: the check then reports the measured peaks as NOT TESTABLE)."""
    if spec:
        module, _, name = spec.partition(":")
        if not (module and name):
            raise SystemExit(f"--memory-plan {spec!r}: expected MODULE:FUNCTION")
        return getattr(importlib.import_module(module), name)
    try:
        planning = importlib.import_module("verl_hpc.planning")
    except ImportError:
        return None
    return getattr(planning, "gpu_check_budget", None)


def table(rows) -> str:
    width = max([len(c.name) for c, *_ in rows] + [5])
    lines = [f"{'check':<{width}}  {'status':<12}  {'s':>6}  detail", "-" * (width + 80)]
    lines += [f"{c.name:<{width}}  {st:<12}  {sec:6.1f}  {detail}" for c, st, detail, sec in rows]
    counts = {s: sum(1 for _, st, *_ in rows if st == s) for s in STATUS_ORDER}
    lines.append(", ".join(f"{n} {s.lower()}" for s, n in counts.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    from verl_hpc.gpu_check.checks import CHECKS

    ap = argparse.ArgumentParser(prog="python -m verl_hpc.gpu_check",
                                 description="Run every GPU path one GPU can exercise; print a table.")
    ap.add_argument("--dry-run", action="store_true", help="list the checks and exit 0 (any machine)")
    ap.add_argument("--out", type=Path, help="work folder (model, checkpoints); default: a temp folder")
    ap.add_argument("--memory-plan", help="MODULE:FUNCTION(component, facts) -> budget bytes or None")
    ap.add_argument("--only", nargs="*", choices=[c.name for c in CHECKS], help="run these checks only")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run the same checks on CPU with gloo and float32 (tests the kit; no GPU result)")
    args = ap.parse_args(argv)
    if args.dry_run:
        print("checks (in order; each runs only if those it needs passed):")
        for c in CHECKS:
            needs = f"  [needs {', '.join(c.needs)}]" if c.needs else ""
            print(f"  {c.name:<20} {c.what}{needs}")
        plan = load_memory_plan(args.memory_plan)
        print(f"memory plan: {'none (peaks are reported, not compared)' if plan is None else plan}")
        return 0
    # Bitwise resume needs deterministic kernels; set before CUDA is initialised.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    import torch

    from verl_hpc.gpu_check.checks import Kit, environment_line, run_checks

    from verl_hpc.runtime.device import has_gpu

    if not args.cpu_rehearsal and not has_gpu():
        print("gpu_check: no CUDA device here. Use --dry-run "
              "to list the checks, or --cpu-rehearsal to test the kit itself on CPU.", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = args.out or Path(tempfile.mkdtemp(prefix="verl_hpc_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    kit = Kit(out=out, rehearsal=args.cpu_rehearsal, plan=load_memory_plan(args.memory_plan))
    rows = run_checks(kit, args.only)
    text = f"{environment_line()}\n{'CPU REHEARSAL: not GPU results' if kit.rehearsal else ''}\n" + table(rows)
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
