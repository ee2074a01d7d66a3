"""A rank's start-up imports with the garbage collector on vs off (verl_hpc/launcher/startup_imports.py).

Each round starts two fresh interpreters, alternated, that import what a colocated rank imports
(torch, transformers' AutoTokenizer, Megatron-Core, vLLM's LLM class): one as Python starts, one
inside `without_gc()`. It prints each one's CPU seconds (user + system, from the child's rusage)
and the ratio of the medians (docs/benchmarks.md).

    python benchmarks/bench_startup.py --rounds 3
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

# a colocated rank's preloads (the default config), each imported outright: one that fails fails the run
IMPORTS = ("import importlib, torch, torch.distributed; from verl_hpc.config import load_config; "
           "from verl_hpc.launcher.startup_imports import modules_for; "
           "[importlib.import_module(m) for m in modules_for(load_config(None, []), 'both')]")
OFF = "from verl_hpc.launcher.startup_imports import without_gc\nwith without_gc():\n    exec({imports!r})"


def cpu_of(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    on, off = [], []
    for r in range(args.rounds):
        on.append(cpu_of(IMPORTS))
        off.append(cpu_of(OFF.format(imports=IMPORTS)))
        print(f"round {r + 1}/{args.rounds}: collector on {on[-1]:.2f} CPU-s, "
              f"off during the imports {off[-1]:.2f} CPU-s", flush=True)
    a, b = statistics.median(on), statistics.median(off)
    print(f"median: on {a:.2f} CPU-s, off {b:.2f} CPU-s: {b / a:.2f}x the CPU ({a - b:.2f} CPU-s less a rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
