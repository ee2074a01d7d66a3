"""Starting ranks of this machine as plain subprocesses, the way torchrun would, for callers that
need each rank's process by handle and its own log file (the GPU kit's two-rank check, the
multi-rank tests). A job itself starts its local ranks with torch's elastic launcher
(verl_hpc.launcher.local), which is the product path.

    store = host_store()                             # served here, as torchrun's agent does
    env = torchrun_env(rank, world_size, store.port) # RANK, WORLD_SIZE, LOCAL_*, MASTER_*
    failed = wait_all(procs, timeout_s)              # one deadline; late ranks killed
"""
from __future__ import annotations

import datetime
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


def host_store(timeout_s: float = 900):
    """The ranks' rendezvous store, served by the calling process as torchrun's agent serves it;
    keep it referenced until the ranks end. The kernel gives it a port while it listens: with a
    port from free_port() handed to rank 0 to open, any process of the machine (another test's
    connection, say) can take it in between, and rank 0 fails with EADDRINUSE."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def torchrun_env(rank: int, world_size: int, port: int, **extra: str) -> Dict[str, str]:
    """This process's environment plus torchrun's variables for one local rank of `world_size`,
    without SLURM_JOB_ID (local ranks, also when the caller runs inside a Slurm job). `port` is a
    store the caller serves (host_store): the ranks join it as torchrun's agent store, as clients."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0", **extra)
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
