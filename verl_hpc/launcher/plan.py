"""A job plan: what will run where, checked and printable before anything is submitted."""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from verl_hpc.config import ConfigError, to_yaml
from verl_hpc.launcher.environment import job_environment


@dataclasses.dataclass
class Plan:
    backend: str  # slurm | local
    reason: str  # why this backend
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    rollout_tp: int
    job: str
    log_dir: Path  # may contain %j (the Slurm job id) until submitted
    env: dict[str, str]

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def describe(self) -> str:
        gpus = f"{self.gpus_per_node} GPU(s)/node" if self.gpus_per_node else "CPU only (gloo)"
        return "\n".join([
            f"plan: trainer.job={self.job} on {self.backend} ({self.reason})",
            f"  ranks: {self.nodes} node(s) x {self.tasks_per_node} = {self.world_size}; {gpus}",
            f"  training layout: tp={self.tp} pp={self.pp} dp={self.dp}; rollout tp={self.rollout_tp}"
            f" ({self.world_size // self.rollout_tp} inference replica(s))",
            f"  logs: {self.log_dir}",
            "  env: " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items())),
        ])


def make_plan(cfg, *, local: bool = False) -> Plan:
    if local:
        backend, reason = "local", "--local"
    elif shutil.which("sbatch") is None:
        backend, reason = "local", "no Slurm here: sbatch is not on PATH"
    else:
        backend, reason = "slurm", "sbatch found"
    log_dir = cfg.slurm.log_dir
    if backend == "local":
        if cfg.slurm.nodes != 1:
            raise_layout(f"slurm.nodes={cfg.slurm.nodes}: a local run has one node; set slurm.nodes=1"
                         " or submit to Slurm")
        log_dir = log_dir.replace("%j", time.strftime("local-%Y%m%d-%H%M%S"))
    return Plan(backend=backend, reason=reason, nodes=cfg.slurm.nodes,
                tasks_per_node=cfg.slurm.tasks_per_node, gpus_per_node=cfg.slurm.gpus_per_node,
                tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.dp, rollout_tp=cfg.rollout.tp,
                job=cfg.trainer.job, log_dir=Path(log_dir).absolute(), env=job_environment(cfg))


def raise_layout(message: str):
    raise ConfigError(message)


RESOLVED_CONFIG = "config.yaml"


def write_resolved_config(cfg, folder: Path) -> Path:
    """The ranks read exactly what was validated, whatever happens to the user's YAML later."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESOLVED_CONFIG
    path.write_text(to_yaml(cfg))
    return path
