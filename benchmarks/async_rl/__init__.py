"""The asynchronous-RL simulator and its measurement, behind one entry point
(`python benchmarks/bench_async.py simulate | simulate-elastic | measure`).

    model.py         the simulated clock: decode and training step times, colocated / split steps
    common.py        what the commands share: the repository root, configs from flags, the plan's numbers
    simulate.py      `simulate`: colocated-sync against split-async per staleness bound
    elastic_sim.py   the same clock with an elastic pool of backfill workers (elastic_engine.py: one engine)
    backfill.py      when idle nodes offer backfill windows, and for how long
    elastic_cli.py   `simulate-elastic`: colocated, fixed split, fixed split + the elastic pool
    measure.py       `measure`: the same comparison run as real jobs on this machine's cores

Imports go one way: model <- common <- the commands <- bench_async.py (nothing here imports the
entry point; tests/unit/test_benchmarks_imports.py fails on a circle).
"""
