"""Starting ranks of this machine as plain subprocesses, the way torchrun would, for callers that
need each rank's process by handle and its own log file (the GPU kit's two-rank check, the
multi-rank tests). A job itself starts its local ranks with torch's elastic launcher
(verl_hpc.launcher.local), which is the product path.

    store = host_store()                             # served here, as torchrun's agent does
    env = torchrun_env(rank, world_size, store.port) # RANK, WORLD_SIZE, LOCAL_*, MASTER_*
    failed = wait_all(procs, timeout_s)              # one deadline; late ranks killed, and the
                                                     # others soon after a rank fails
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


# after the first rank fails, the others' own time to end (their errors are the next lines of
# their logs, often the telling ones) before they are killed: a rank left waiting on the failed one
# in a collective or a rendezvous would otherwise hold the caller to the whole deadline
FAILED_GRACE_S = 5.0


def wait_all(procs: List[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for every rank under one deadline, which the first failed rank shortens to
    FAILED_GRACE_S; kill (and reap) those still running after it. True when any rank failed or was late."""
    deadline = time.time() + timeout_s
    while True:
        codes = [proc.poll() for proc in procs]
        if None not in codes or time.time() >= deadline:
            break
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.time() + FAILED_GRACE_S)
        time.sleep(0.1)
    failed = any(code != 0 for code in codes)  # a rank still running (None) is late
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return failed
