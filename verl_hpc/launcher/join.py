"""`python -m verl_hpc.submit --join RUN_DIR [overrides] [--workers N] [--local]`: rollout workers for a
running elastic split run (docs/elastic.md), each a Slurm job of its own (a job array of N tasks),
or with --local (or no Slurm here) one worker in this process.

The run's folder says where the run is and what it generates with (its rendezvous and config,
trainer/placement/elastic/rendezvous.py): nothing else is needed. Overrides set the worker's own
allocation and engine: `slurm.partition`, `slurm.time_min`, `slurm.qos`, `slurm.account`,
`slurm.constraint`, `slurm.cpus_per_task`, `rollout.engine`,
`rollout.gpu_memory_utilization`, ...; one that changes what the samples are (the model, the
sampling, the lengths) is refused, naming it. The check runs here first, so a worker for an ended
run or with a wrong override never queues.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import List


def join(run_dir: str, overrides: List[str], *, workers: int, local: bool) -> int:
    from verl_hpc.config import load_config
    from verl_hpc.trainer.placement.elastic.rendezvous import Rendezvous, config_path

    rdv = Rendezvous.join(run_dir)  # is there a running run at all
    Rendezvous.join(run_dir, load_config(str(config_path(run_dir)), overrides))  # and may this worker join it
    if local or shutil.which("sbatch") is None:
        # here the worker runs in this process: its store must answer here (a login node may not reach
        # a compute node's port, so Slurm workers check it themselves, with the same one line)
        rdv.check_store()
        from verl_hpc.trainer.placement.elastic import worker

        if workers != 1:
            print(f"[submit] --join --local runs one worker in this process (--workers {workers} is for Slurm)",
                  file=sys.stderr)
            return 2
        return worker.main([run_dir, *overrides])
    return _submit(run_dir, overrides, workers)


def worker_parameters(cfg) -> dict:
    """One worker's allocation as submitit.SlurmExecutor parameters: one node, one task, the
    rollout's GPUs (rollout.tp of them, 1 for a worker, where the run has GPUs), the run's Slurm
    account fields and warning signal, the worker's own time limit."""
    s = cfg.slurm
    params = dict(job_name=f"{s.job_name}_rollout_worker", nodes=1, ntasks_per_node=1, cpus_per_task=s.cpus_per_task,
                  time=s.time_min, signal_delay_s=s.signal_delay_s, additional_parameters=dict(s.additional))
    if s.gpus_per_node:
        params["gpus_per_node"] = cfg.rollout.tp
    params.update({key: getattr(s, key) for key in ("partition", "account", "qos", "constraint") if getattr(s, key)})
    if s.mem_gb:
        params["mem"] = f"{s.mem_gb}GB"
    return params


def _submit(run_dir: str, overrides: List[str], workers: int) -> int:
    import submitit

    from verl_hpc.config import load_config
    from verl_hpc.trainer.placement.elastic import worker
    from verl_hpc.trainer.placement.elastic.rendezvous import config_path

    cfg = load_config(str(config_path(run_dir)), overrides)
    folder = Path(run_dir) / "elastic" / "workers" / "%j"
    ex = submitit.SlurmExecutor(folder=str(folder), python=sys.executable)
    ex.update_parameters(**worker_parameters(cfg))
    jobs = ex.map_array(worker.main, [[run_dir, *overrides]] * workers)
    print(f"[submit] {len(jobs)} rollout worker(s) submitted for {run_dir}: job {jobs[0].job_id.split('_')[0]} "
          f"(array of {len(jobs)}); logs under {folder.parent}", flush=True)
    return 0
