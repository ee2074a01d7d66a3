"""Start N local gloo ranks of a test's rank script the way torchrun would, and collect what each
rank wrote: the one launcher of the tests/dist/*/*_ranks.py scripts.

    ranks = launch_ranks(SCRIPT, 2, args, workdir, what="resharding scenario")   # [rank0.json, ...]
    port, procs = start_ranks(SCRIPT, 4, args, workdir, argv=["kill_during_save"])  # to kill -9 them

Each rank runs `python SCRIPT *argv WORKDIR` from the repository root with torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT of a rendezvous store this
process serves, as torchrun's agent does), one OpenMP
thread (2 cores shared by all ranks), vLLM in-process, outside any Slurm job the test itself may
run in, and its output in WORKDIR/rank{r}.log. `args` go to WORKDIR/args.json; each rank leaves
WORKDIR/rank{r}.json. One deadline for all ranks: a rank that fails or is late gets every rank
killed (our own children, by handle) and the tails of every log raised in one AssertionError.

Not torch's elastic launcher: these tests need the ranks' processes by handle (kill -9 mid-save),
per-rank log files the assertion can quote, and the port (the rollout test checks names made
from it); verl_hpc.launcher.local uses elastic_launch where the job is the product.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

from verl_hpc.runtime.local_ranks import host_store, torchrun_env, wait_all

REPO = Path(__file__).resolve().parents[1]


def start_ranks(script, world_size: int, args: dict, workdir, *, argv: Sequence[str] = (),
                log_level: str = "WARNING") -> Tuple[int, List[subprocess.Popen]]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "args.json").write_text(json.dumps(args))
    store, procs = host_store(), []
    port = store.port
    for rank in range(world_size):
        env = torchrun_env(rank, world_size, port, OMP_NUM_THREADS="1", VERL_HPC_LOGLEVEL=log_level,
                           PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
                           VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
        with open(workdir / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(script), *argv, str(workdir)],
                                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    for proc in procs:
        proc.rendezvous_store = store  # served for as long as anyone holds the ranks
    return port, procs


def wait_ranks(procs: List[subprocess.Popen], workdir, *, timeout: float, what: str) -> None:
    if wait_all(procs, timeout):
        tails = [f"--- rank {r} (rc {p.returncode}) ---\n" + (Path(workdir) / f"rank{r}.log").read_text()[-5000:]
                 for r, p in enumerate(procs)]
        raise AssertionError(f"{what} on {len(procs)} ranks failed:\n" + "\n".join(tails))


def launch_ranks(script, world_size: int, args: dict, workdir, *, argv: Sequence[str] = (),
                 timeout: float = 300, what: str = "scenario", log_level: str = "WARNING",
                 with_port: bool = False):
    """Run the ranks to the end; their rank{r}.json contents in rank order (and the port used)."""
    port, procs = start_ranks(script, world_size, args, workdir, argv=argv, log_level=log_level)
    wait_ranks(procs, workdir, timeout=timeout, what=what)
    results = [json.loads((Path(workdir) / f"rank{r}.json").read_text()) for r in range(world_size)]
    return (port, results) if with_port else results
