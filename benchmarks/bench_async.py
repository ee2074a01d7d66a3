"""Asynchronous RL: colocated-synchronous against split-asynchronous placement.

    python benchmarks/bench_async.py simulate                       # 64 H100s, 7B, k = 0, 1, 2, 4
    python benchmarks/bench_async.py simulate --gpus 128 --rollout-gpus 64 --ks 1 --out sim.json
    python benchmarks/bench_async.py simulate --len-sigma 0          # every response the same length
    python benchmarks/bench_async.py simulate-elastic                # + backfill workers on a 64-node cluster
    python benchmarks/bench_async.py measure                         # real jobs on this machine's cores
    python benchmarks/bench_async.py measure --quick                 # the same, short

The one entry point of the simulator and its measurement, which live in benchmarks/async_rl/:
- `simulate` (async_rl/simulate.py) runs no model: a discrete-event simulation of RL steps on a
  simulated clock (async_rl/model.py says what it models), its numbers from the job config's
  memory/time plan (async_rl/common.py, shared by the three commands).
- `simulate-elastic` adds an elastic pool of rollout workers in backfill windows to the same clock:
  async_rl/elastic_cli.py says what it reports, elastic_sim.py how, backfill.py the windows' source.
- `measure` runs the same job colocated (1 rank x 2 threads; 2 ranks x 1 thread) and split (1 rollout
  + 1 training rank, k = 1) on the same cores: async_rl/measure.py says what it reports.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from async_rl.common import ROOT  # noqa: F401  (puts this checkout's verl_hpc on sys.path)
from async_rl.elastic_cli import add_simulate_elastic
from async_rl.measure import add_measure
from async_rl.simulate import add_simulate
from verl_hpc.errors import VerlHpcError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_simulate(sub)
    add_simulate_elastic(sub)  # the same clock with backfill workers joining and leaving
    add_measure(sub)  # the same task, model and settings run colocated-sync and split-async on this machine
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # measure writes the command line into its results
    try:
        return args.func(args)
    except VerlHpcError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
