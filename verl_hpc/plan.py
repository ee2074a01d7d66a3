"""`python -m verl_hpc.plan CONFIG [overrides] [--gpu-memory-gb N] [--suggest]`: the memory plan.

Prints bytes per rank for each phase of the RL step x each component, the host memory per node,
and the peak against the GPU's memory (slurm.gpu_type, or --gpu-memory-gb; a CPU job is compared
against the node's RAM). Exits 0 when the peak fits, 1 when it does not (the line names the peak),
2 for a bad config. --suggest searches layouts, recompute, offload and micro-batch budgets that fit
with 10% headroom and ranks them by an estimated step time. Needs no torch and no GPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

if __name__ == "__main__":  # SIGTERM or Ctrl-C: one line and 143 / 130, no traceback, from the first line
    from verl_hpc.launcher import early_signals

    early_signals.install("plan", "before the plan was complete")

from verl_hpc.config import ConfigError, load_config, validate  # noqa: E402
from verl_hpc.errors import VerlHpcError  # noqa: E402


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m verl_hpc.plan", description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="YAML job config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=4")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="GPU memory (GB = 1e9 bytes)")
    p.add_argument("--node-memory-gb", type=float, default=None, help="host RAM per node (GB)")
    p.add_argument("--suggest", action="store_true", help="search layouts that fit and rank them")
    p.add_argument("--top", type=int, default=8, help="--suggest: how many layouts to show (>= 1)")
    args = p.parse_intermixed_args(argv)
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def suggest_command(config: Optional[str], overrides: List[str]) -> str:
    return " ".join(["python -m verl_hpc.plan", config or "", *overrides, "--suggest"]).replace("  ", " ")


def main(argv: Optional[List[str]] = None) -> int:
    from verl_hpc.planning import full_report, plan_job, refusal

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.top < 1:  # a negative count sliced the list from its end: all but the last layouts
            raise ConfigError(f"--top: got {args.top}; valid: how many layouts --suggest shows, >= 1")
        cfg = load_config(args.config, args.overrides)
        validate(cfg, check_model=False)  # the plan reads the model's shape itself
        plan = plan_job(cfg, gpu_memory_gb=args.gpu_memory_gb, node_memory_gb=args.node_memory_gb)
    except VerlHpcError as err:  # a ConfigError (2): the config, the model's config.json, an option
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
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
