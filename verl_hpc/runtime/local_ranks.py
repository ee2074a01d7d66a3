"""Starting ranks of this machine as plain subprocesses, the way torchrun would, for callers that
need each rank's process by handle and its own log file (the GPU kit's two-rank check, the
multi-rank tests). A job itself starts its local ranks with torch's elastic launcher
(verl_hpc.launcher.local), which is the product path.

    port = free_port()
    env = torchrun_env(rank, world_size, port)       # RANK, WORLD_SIZE, LOCAL_*, MASTER_*
    failed = wait_all(procs, timeout_s)              # one deadline; late ranks killed
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Dict, List


def free_port() -> int:
    """A TCP port free on the loopback interface now (the rendezvous of local ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int, **extra: str) -> Dict[str, str]:
    """This process's environment plus torchrun's variables for one local rank of `world_size`,
    without SLURM_JOB_ID (local ranks, also when the caller runs inside a Slurm job)."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               **extra)
    env.pop("SLURM_JOB_ID", None)
    return env


def wait_all(procs: List[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for every rank under one deadline; kill (and reap) those still running after it.
    True when any rank failed or was late."""
    deadline, failed = time.time() + timeout_s, False
    for proc in procs:
        try:
            failed |= proc.wait(timeout=max(1.0, deadline - time.time())) != 0
        except subprocess.TimeoutExpired:
            failed = True
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return failed
