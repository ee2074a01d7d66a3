"""`python -m verl_hpc.plan CONFIG [overrides] [--gpu-memory-gb N] [--suggest | --longest]`: the memory plan.

Prints bytes per rank for each phase of the RL step x each component, the host memory per node,
and the peak against the GPU's memory (slurm.gpu_type, or --gpu-memory-gb; a CPU job is compared
against the node's RAM). Exits 0 when the peak fits, 1 when it does not (the line names the peak),
2 for a bad config. --suggest searches layouts, recompute, offload and micro-batch budgets that fit
with 10% headroom and ranks them by an estimated step time. --longest prints, instead of the plan,
the longest data.max_response_length each layout fits, with and without the sequence split over
more ranks (parallel.cp / fsdp.sp; planning/longest.py). Needs no torch and no GPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

if __name__ == "__main__":  # SIGTERM or Ctrl-C: one line and 143 / 130, no traceback, from the first line
    from verl_hpc.launcher import early_signals

    early_signals.install("plan", "before the plan was complete")

from verl_hpc.config import load_config, validate  # noqa: E402
from verl_hpc.config.errors import raise_if_any  # noqa: E402
from verl_hpc.errors import VerlHpcError  # noqa: E402


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_hpc.plan", description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="YAML job config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=4")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="GPU memory (GB = 1e9 bytes)")
    p.add_argument("--node-memory-gb", type=float, default=None, help="host RAM per node (GB)")
    p.add_argument("--suggest", action="store_true", help="search layouts that fit and rank them")
    p.add_argument("--top", type=int, default=8, help="--suggest: how many layouts to show (>= 1)")
    p.add_argument("--longest", action="store_true",
                   help="the longest response each layout fits, with and without parallel.cp / fsdp.sp")
    p.add_argument("--headroom", type=float, default=None,
                   help="--longest: the fraction of the GPU's memory a fit keeps free (0 <= x < 1; default 0)")
    args = p.parse_intermixed_args(argv)
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def suggest_command(config: Optional[str], overrides: List[str], flag: str = "--suggest") -> str:
    return " ".join(["python -m verl_hpc.plan", config or "", *overrides, flag]).replace("  ", " ").strip()


def option_problems(args: argparse.Namespace) -> List[str]:
    """Combinations of the options that mean nothing, one line each."""
    p = []
    if args.top < 1:  # a negative count sliced the list from its end: all but the last layouts
        p.append(f"--top: got {args.top}; valid: how many layouts --suggest shows, >= 1")
    if args.longest and args.suggest:
        p.append("--longest with --suggest: one search at a time; --longest keeps the config's layout "
                 "(adding parallel.cp / fsdp.sp), --suggest changes it")
    if args.headroom is not None and not args.longest:
        p.append("--headroom without --longest: it is the headroom --longest's fits keep")
    elif args.headroom is not None and not 0 <= args.headroom < 1:
        p.append(f"--headroom: got {args.headroom}; valid: a fraction of the GPU's memory, 0 <= x < 1")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from verl_hpc.planning import full_report, plan_job, refusal

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        raise_if_any(option_problems(args))
        cfg = load_config(args.config, args.overrides)
        validate(cfg, check_model=False)  # the plan reads the model's shape itself
        plan = plan_job(cfg, gpu_memory_gb=args.gpu_memory_gb, node_memory_gb=args.node_memory_gb)
    except VerlHpcError as err:  # a ConfigError (2): the config, the model's config.json, an option
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if args.longest:
        from verl_hpc.planning.longest import longest, print_longest

        print_longest(longest(cfg, gpu_memory_gb=args.gpu_memory_gb, node_memory_gb=args.node_memory_gb,
                              margin=args.headroom or 0.0),
                      suggest_command(args.config, args.overrides, "").strip())
        return 0
    print(full_report(plan))
    if args.suggest:
        from verl_hpc.planning.suggest import print_suggestions, suggest

        print()
        print_suggestions(suggest(cfg, gpu_memory_gb=args.gpu_memory_gb,
                                  node_memory_gb=args.node_memory_gb), top=args.top)
    if not plan.fits():
        print(refusal(plan, suggest_command(args.config, args.overrides)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
