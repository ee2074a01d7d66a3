"""Start N local gloo ranks of a test's rank script the way torchrun would, and collect what each
rank wrote: the one launcher of the tests/dist/*/*_ranks.py scripts.

    ranks = launch_ranks(SCRIPT, 2, args, workdir, what="resharding scenario")   # [rank0.json, ...]
    port, procs = start_ranks(SCRIPT, 4, args, workdir, argv=["kill_during_save"])  # to kill -9 them

Each rank runs SCRIPT as `__main__` with argv `SCRIPT *argv WORKDIR`, from the repository root,
with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT of a
rendezvous store this process serves, as torchrun's agent does), one OpenMP thread (2 cores shared
by all ranks), vLLM in-process, outside any Slurm job the test itself may run in, and its output in
WORKDIR/rank{r}.log. `args` go to WORKDIR/args.json; each rank leaves WORKDIR/rank{r}.json. One
deadline for all ranks: a rank that fails or is late gets every rank killed (our own children, by
handle) and the tails of every log raised in one AssertionError.

The ranks are forked from a fork server (multiprocessing's) that has imported torch, transformers
and Megatron-Core once: a fresh interpreter spends about 5 s of CPU on those imports before a rank
does anything, and the suite starts some 60 ranks on 2 cores. Each rank still gets the environment
above as its own, its own process (killed, signalled and reaped by handle) and its own log; nothing
of one rank outlives it. The product's own ranks (verl_hpc.launcher.local, torch's elastic
launcher) are fresh interpreters, and the job tests run those.

Not torch's elastic launcher: these tests need the ranks' processes by handle (kill -9 mid-save),
per-rank log files the assertion can quote, and the port (the rollout test checks names made
from it); verl_hpc.launcher.local uses elastic_launch where the job is the product.
"""
from __future__ import annotations

import atexit
import gc
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Sequence, Tuple
from unittest import mock

import vllm_seen
from verl_hpc.runtime.local_ranks import host_store, torchrun_env, wait_all

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# What the rank scripts import before their first step. Not the data modules: pyarrow starts a
# (jemalloc) thread at import, and a process with threads is not one to fork from.
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils", "megatron.core",
           "megatron.core.models.gpt", "megatron.core.pipeline_parallel", "megatron.core.distributed",
           "megatron.core.optimizer", "verl_hpc.runtime", "verl_hpc.engines.megatron.engine",
           "vllm_seen",  # notes a rank's vLLM for the `vllm` marker's check (tests/vllm_selection.py)
           "heap_frozen")  # last: freezes what the others imported (tests/heap_frozen.py)


def _rank_env(rank: int, world_size: int, port: int, log_level: str) -> Dict[str, str]:
    # the running test's vLLM notes (tests/vllm_seen.py, preloaded: a forked rank notes its vLLM)
    seen = {vllm_seen.ENV: os.environ[vllm_seen.ENV]} if vllm_seen.ENV in os.environ else {}
    return torchrun_env(rank, world_size, port, OMP_NUM_THREADS="1", VERL_HPC_LOGLEVEL=log_level,
                        PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
                        VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING", **seen)


def _fork_server():
    """multiprocessing's fork server of this process, with the PRELOAD modules. It starts at the
    first rank's `Process.start()`, and starts again there if it is gone (a test that kills every
    process under the worker takes the server too): each start runs under `_server_env`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _server_env():
    """The environment the fork server starts with: the ranks' (what the libraries read while they
    are imported: OMP_NUM_THREADS, the warning filters), and tests/ on its path for heap_frozen
    (Python 3.11's server ignores the sys.path it is handed, and skips a preload module it cannot
    import without a word)."""
    env = _rank_env(0, 1, 0, "WARNING")
    env["PYTHONPATH"] += os.pathsep + str(TESTS)
    return mock.patch.dict(os.environ, env, clear=True)


def _run_rank(script: str, argv: List[str], env: Dict[str, str], log_path: str) -> None:
    """A forked rank: what `python SCRIPT *argv` with `env` and its output to `log_path` would do."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if gc.get_freeze_count() == 0:  # the preload's last module did not run: ranks slower, not wrong, so said here
        raise RuntimeError("the fork server's heap is not frozen: tests/heap_frozen.py, the last of "
                           "rank_launcher.PRELOAD, was not imported by the server")
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path[:0] = [str(Path(script).parent), *env["PYTHONPATH"].split(os.pathsep)]
    sys.path.remove(str(TESTS))  # the server's, for its preload; a fresh rank's path has no tests/
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # a forked process ends with os._exit: run the exit handlers an interpreter would
        atexit._run_exitfuncs()


def _forked(context, rank: int, script: str, argv: List[str], env: Dict[str, str], log_path: Path):
    """The rank forked by the server; None (and a warning in the test's report) where the server
    did not answer (seen when a test killed every process under its worker, the server among them,
    and the next module's start-up restarted it mid-way; a test kills only what it started now): the
    rank then starts as a fresh interpreter, which changes its start-up time and nothing it computes."""
    process = context.Process(target=_run_rank, name=f"rank{rank}", args=(script, argv, env, str(log_path)))
    try:
        with _server_env():  # where the server (re)starts: in start(), if it is not running
            process.start()
    except (EOFError, OSError) as err:
        warnings.warn(f"the fork server did not start rank {rank} of {script} ({err!r}): "
                      "it starts as a fresh interpreter")
        return None
    return ForkedRank(process)


class ForkedRank:
    """A forked rank behind the part of subprocess.Popen's interface the tests use."""

    def __init__(self, process: multiprocessing.Process):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout: float = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_ranks(script, world_size: int, args: dict, workdir, *, argv: Sequence[str] = (),
                log_level: str = "WARNING", fresh: bool = False) -> Tuple[int, list]:
    """The ranks, running: forked from the fork server, or with `fresh` each a fresh interpreter
    (`python SCRIPT ...`), for a scenario that checks what a process leaves behind when it exits
    (a forked rank ends with os._exit, so no C++ destructor runs: vLLM's shared-memory segments
    would stay)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "args.json").write_text(json.dumps(args))
    store, procs = host_store(), []
    port, context = store.port, None if fresh else _fork_server()
    for rank in range(world_size):
        env, log_path = _rank_env(rank, world_size, port, log_level), workdir / f"rank{rank}.log"
        forked = None if fresh else _forked(context, rank, str(script), [*argv, str(workdir)], env, log_path)
        if forked is not None:
            procs.append(forked)
        else:
            with open(log_path, "w") as log:
                procs.append(subprocess.Popen([sys.executable, str(script), *argv, str(workdir)],
                                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    for proc in procs:
        proc.rendezvous_store = store  # served for as long as anyone holds the ranks
    return port, procs


def wait_ranks(procs: list, workdir, *, timeout: float, what: str) -> None:
    if wait_all(procs, timeout):
        tails = [f"--- rank {r} (rc {p.returncode}) ---\n" + (Path(workdir) / f"rank{r}.log").read_text()[-5000:]
                 for r, p in enumerate(procs)]
        raise AssertionError(f"{what} on {len(procs)} ranks failed:\n" + "\n".join(tails))


def launch_ranks(script, world_size: int, args: dict, workdir, *, argv: Sequence[str] = (),
                 timeout: float = 300, what: str = "scenario", log_level: str = "WARNING",
                 with_port: bool = False, fresh: bool = False):
    """Run the ranks to the end; their rank{r}.json contents in rank order (and the port used)."""
    port, procs = start_ranks(script, world_size, args, workdir, argv=argv, log_level=log_level, fresh=fresh)
    wait_ranks(procs, workdir, timeout=timeout, what=what)
    results = [json.loads((Path(workdir) / f"rank{r}.json").read_text()) for r in range(world_size)]
    return (port, results) if with_port else results
