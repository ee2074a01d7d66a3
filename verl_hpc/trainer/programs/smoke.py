"""The distributed smoke job: proves N ranks can talk, and that failures and signals behave.

Each step all-reduces over torch.distributed (and MPI where the launcher gave one) and checks the
answer; rank and world size must agree between the launcher, torch.distributed and MPI. Knobs in
`trainer.smoke` make one rank die on purpose, which the tests use to check that the job fails fast.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from verl_hpc.runtime.device import collective_device
from verl_hpc.runtime.watchdog import StageWatchdog

log = logging.getLogger(__name__)


def _fail_on_purpose(mode: str, rank: int, step: int) -> None:
    if mode == "hang":
        log.error("smoke: rank %d hangs on purpose at step %d (trainer.smoke.fail_mode=hang)", rank, step)
        while True:  # alive but silent: its stage watchdog (or the others' collective timeout) ends the job
            time.sleep(3600)
    log.error("smoke: rank %d dies on purpose at step %d (trainer.smoke.fail_rank)", rank, step)
    logging.shutdown()
    os._exit(3)  # no cleanup, like a segfault or an OOM kill: the others must not hang


def run(cfg, ctx) -> dict:
    s = cfg.trainer.smoke
    rank, world = ctx.rank, ctx.world_size
    if (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise RuntimeError(f"torch.distributed says rank {dist.get_rank()}/{dist.get_world_size()}, "
                           f"launcher says {rank}/{world}")
    expected = world * (world + 1) // 2
    steps_done, t0 = 0, time.time()
    dog = StageWatchdog(cfg.trainer.stage_timeout_s, rank).start()
    for step in range(s.steps):
        dog.stage(f"smoke step {step}")
        if rank == s.fail_rank and step == s.fail_at_step:
            _fail_on_purpose(s.fail_mode, rank, step)
        t = torch.tensor([float(rank + 1)], device=collective_device())
        dist.all_reduce(t)
        if int(t.item()) != expected:
            raise RuntimeError(f"all_reduce gave {t.item()}, expected {expected}")
        if s.mpi and ctx.mpi_comm is not None and ctx.mpi_comm.allreduce(rank + 1) != expected:
            raise RuntimeError("MPI allreduce disagrees with torch.distributed")
        time.sleep(s.step_seconds)
        steps_done = step + 1
        if rank == 0:
            rate = steps_done / max(time.time() - t0, 1e-9)
            log.info("smoke step %d/%d ok (all_reduce=%d) %.1f steps/s, ETA %.0fs", steps_done,
                     s.steps, expected, rate, (s.steps - steps_done) / rate)
        # after the last step there is nothing left to stop: the run ends as finished, whatever came
        # (every rank skips the same collective)
        if steps_done < s.steps and ctx.preemption.agreed():
            log.warning("smoke: preemption flag set at step %d; stopping early", steps_done)
            break

    dog.stop()
    mine = dict(rank=rank, world_size=world, launcher=ctx.env.launcher, host=socket.gethostname(),
                local_rank=ctx.env.local_rank, local_world_size=ctx.env.local_world_size,
                node_rank=ctx.env.node_rank, master_addr=ctx.env.master_addr,
                master_port=ctx.env.master_port, job_id=ctx.env.job_id, backend=ctx.backend,
                torch_rank=dist.get_rank(), torch_world=dist.get_world_size(),
                mpi_rank=ctx.mpi_comm.Get_rank() if ctx.mpi_comm is not None else None,
                mpi_size=ctx.mpi_comm.Get_size() if ctx.mpi_comm is not None else None,
                # the signal this rank saw by the loop's end, and the one every rank stopped on (None
                # if none): a signal sent to every rank can reach one after the others agreed on theirs
                preempted=ctx.preemption.is_set(), signal=ctx.preemption.signal_name,
                stopped_on=ctx.preemption.agreed_signal,
                steps=steps_done)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    summary = dict(ok=all(r["torch_rank"] == r["rank"] for r in everyone), world_size=world,
                   steps=steps_done, total_steps=s.steps, ranks=everyone, seconds=round(time.time() - t0, 3))
    if rank == 0:
        out = Path(cfg.trainer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "smoke_result.json").write_text(json.dumps(summary, indent=1))
        print(f"SMOKE_RESULT {json.dumps(summary)}", flush=True)
        log.info("smoke: %d ranks agreed on rank/world size over %d steps; result in %s",
                 world, steps_done, out / "smoke_result.json")
    return summary
