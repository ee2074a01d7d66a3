"""Who am I? Rank, world size and rendezvous address from whatever launcher started this process.

Launchers are recognised in a fixed order, most explicit first, because their variables overlap:
torchrun (RANK/WORLD_SIZE) > mpirun (OMPI_COMM_WORLD_*) > srun job step (SLURM_PROCID inside a
step) > a single plain process. `mpirun` inside a Slurm allocation leaves SLURM_PROCID=0 on every
rank (docs/platform-notes.md, "Slurm and MPI"), which is why Open MPI's variables are read before Slurm's.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Mapping

from verl_hpc.config.errors import ConfigError
from verl_hpc.runtime.faults import ATTEMPT_ENV
from verl_hpc.runtime.local_ranks import free_port


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # torchrun | mpirun | srun | single
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str = ""
    # srun --mpi=pmix and mpirun give every rank an MPI world: mpi4py may be initialised.
    mpi_capable: bool = False


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"launcher variable {key} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"launcher variable {key}={value!r} is not an integer") from None


def port_for_job(job_id: str, launch: int = 0) -> int:
    """A rendezvous port every rank of a job derives alike; different jobs on a node differ. Each
    in-allocation restart's srun (`launch`, VERL_HPC_ATTEMPT: launcher/restart_loop.py) takes
    another: the last launch's rank 0 may still hold its port while its step ends."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 20000 + (int(digits[-6:]) + 7919 * launch) % 20000


def expand_first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as 'gpu[012-015,020],login1'.

    `scontrol show hostnames` is the authority and is used when present; the small parser below
    covers the common bracket form for nodes where scontrol is not on PATH inside a container.
    """
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                                 capture_output=True, text=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not first:
        raise ConfigError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = first.groups()
    if not ranges:
        return prefix
    start = ranges.split(",")[0].split("-")[0]
    return prefix + start


def tasks_on_node(spec: str, node_id: int) -> int:
    """Tasks on node `node_id` from Slurm's compact per-node list, e.g. "2(x3),1" -> 2,2,2,1.
    An uneven step ("3,2") has a different count on each node, so the first entry is not enough."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"cannot parse SLURM_STEP_TASKS_PER_NODE={spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ConfigError(f"SLURM_NODEID={node_id} is outside SLURM_STEP_TASKS_PER_NODE={spec!r}")
    return counts[node_id]


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            launcher="torchrun", rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK", 0), local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            node_rank=_int(env, "GROUP_RANK", 0), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500), job_id=env.get("SLURM_JOB_ID", ""))
    if "OMPI_COMM_WORLD_RANK" in env:
        # mpirun gives no rendezvous address; MASTER_ADDR/PORT must be exported (mpirun -x) or are
        # agreed over MPI itself in runtime.distributed (rank 0's host, a port from the job id).
        return LaunchEnv(
            launcher="mpirun", rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            world_size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
            node_rank=_int(env, "OMPI_COMM_WORLD_NODE_RANK", 0),
            master_addr=env.get("MASTER_ADDR", ""), master_port=_int(env, "MASTER_PORT", 0),
            job_id=env.get("SLURM_JOB_ID", ""), mpi_capable=True)
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        job_id = env.get("SLURM_JOB_ID", "0")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        return LaunchEnv(
            launcher="srun", rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                                           or env.get("SLURM_TASKS_PER_NODE", "1"),
                                           _int(env, "SLURM_NODEID", 0)),
            node_rank=_int(env, "SLURM_NODEID", 0),
            master_addr=env.get("MASTER_ADDR") or expand_first_host(nodelist),
            master_port=_int(env, "MASTER_PORT", port_for_job(job_id, _int(env, ATTEMPT_ENV, 0))),
            job_id=job_id,
            mpi_capable="PMIX_RANK" in env or "PMI_RANK" in env)
    return LaunchEnv(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
                     node_rank=0, master_addr="127.0.0.1", master_port=free_port())
