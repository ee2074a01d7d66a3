"""A job plan: what will run where, checked and printable before anything is submitted."""
from __future__ import annotations

import dataclasses
import shutil
import signal
import time
from pathlib import Path

from verl_hpc.config import ConfigError, to_yaml
from verl_hpc.config.sections.placement import rank_role
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
    # placement.mode = split: the job's first rollout_ranks ranks hold only the rollout engine
    rollout_ranks: int = 0  # 0: colocated, every rank rolls out and trains
    rollout_engine: str = "vllm"
    # a heterogeneous job: rollout_nodes more nodes from rollout_partition, before the `nodes`
    # training nodes (placement.rollout_partition; "" = one allocation)
    rollout_nodes: int = 0
    rollout_partition: str = ""
    # in-allocation restarts (docs/resilience.md): how many, the back-off, the spare nodes, the
    # heartbeat timeout (0: not watched)
    max_restarts: int = 0
    restart_backoff_s: float = 0.0
    spare_nodes: int = 0
    heartbeat_timeout_s: float = 0.0

    @property
    def hetjob(self) -> bool:
        return bool(self.rollout_partition)

    @property
    def world_size(self) -> int:
        return (self.nodes + (self.rollout_nodes if self.hetjob else 0)) * self.tasks_per_node

    @property
    def rollout_world_size(self) -> int:
        return self.rollout_ranks or self.world_size

    def describe(self) -> str:
        replicas = self.rollout_world_size // self.rollout_tp
        return "\n".join([
            f"plan: trainer.job={self.job} on {self.backend} ({self.reason})",
            self._ranks_line(),
            *([self.split_line()] if self.rollout_ranks else []),
            f"  training layout: tp={self.tp} pp={self.pp} dp={self.dp}; rollout tp={self.rollout_tp}"
            f" ({replicas} inference replica(s))",
            *([self.restarts_line()] if self.max_restarts else []),
            f"  logs: {self.log_dir}",
            "  env: " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items())),
        ])

    def _ranks_line(self) -> str:
        gpus = f"{self.gpus_per_node} GPU(s)/node" if self.gpus_per_node else "CPU only (gloo)"
        if not self.hetjob:
            return f"  ranks: {self.nodes} node(s) x {self.tasks_per_node} = {self.world_size}; {gpus}"
        return (f"  ranks: ({self.rollout_nodes} rollout node(s) of partition {self.rollout_partition!r} + "
                f"{self.nodes} training node(s)) x {self.tasks_per_node} = {self.world_size}; {gpus}; "
                "a heterogeneous job, one srun step")

    def restarts_line(self) -> str:
        """`restarts: up to 2 from the latest checkpoint inside the allocation (back-off 10 s); ...`."""
        spare = f"; {_count(self.spare_nodes, 'spare node')}" if self.spare_nodes else ""
        beat = (f"; a rank silent for {self.heartbeat_timeout_s:g} s is killed" if self.heartbeat_timeout_s
                else "; heartbeats not watched")
        where = "the allocation" if self.backend == "slurm" else "this submitter"
        return (f"  restarts: up to {self.max_restarts} after a rank dies, from the latest checkpoint, inside "
                f"{where} (back-off {self.restart_backoff_s:g} s){spare}{beat}")

    def split_line(self) -> str:
        """`split: 1 rollout rank (vLLM, tp 1) + 1 training rank (tp 1 pp 1 dp 1)`."""
        engine = {"vllm": "vLLM", "hf": "HF generate"}.get(self.rollout_engine, f"rollout.engine {self.rollout_engine}")
        train = self.world_size - self.rollout_ranks
        return (f"  split: {_count(self.rollout_ranks, 'rollout rank')} ({engine}, tp {self.rollout_tp}) + "
                f"{_count(train, 'training rank')} (tp {self.tp} pp {self.pp} dp {self.dp})")


def rank_label(rank: int, rollout_ranks: int = 0) -> str:
    """`rank 3` in a failure report; in a split job (rollout_ranks > 0) with its group, `rank 0
    (rollout)` or `rank 3 (train)`: which side died tells what the other side's error means."""
    return f"rank {rank}" + (f" ({rank_role(rank, rollout_ranks)})" if rollout_ranks else "")


def exit_words(code: int) -> str:
    """An exit code as a reader wants it: `-9 (SIGKILL)` for a death by signal (what Python's
    subprocess reports), `137 (128 + SIGKILL)` for a shell's way of saying the same; else the code."""
    number = -code if code < 0 else code - 128 if 128 < code < 128 + signal.NSIG else 0
    if not number:
        return str(code)
    try:
        name = signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return str(code)
    return f"{code} ({name})" if code < 0 else f"{code} (128 + {name})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


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
        if cfg.placement.hetjob:
            raise_layout(f"placement.rollout_partition = {cfg.placement.rollout_partition!r} asks for a Slurm "
                         "heterogeneous job; a local run has one node: set placement.rollout_partition='' "
                         "(the rollout ranks are then this node's first) or submit to Slurm")
        log_dir = log_dir.replace("%j", time.strftime("local-%Y%m%d-%H%M%S"))
    pl = cfg.placement
    return Plan(backend=backend, reason=reason, nodes=cfg.slurm.nodes,
                tasks_per_node=cfg.slurm.tasks_per_node, gpus_per_node=cfg.slurm.gpus_per_node,
                tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.dp, rollout_tp=cfg.rollout.tp,
                job=cfg.trainer.job, log_dir=Path(log_dir).absolute(), env=job_environment(cfg),
                rollout_ranks=cfg.rollout_world_size if pl.split else 0, rollout_engine=cfg.rollout.engine,
                rollout_nodes=pl.added_nodes, rollout_partition=pl.rollout_partition if pl.hetjob else "",
                max_restarts=cfg.slurm.max_restarts, restart_backoff_s=cfg.slurm.restart_backoff_s,
                spare_nodes=cfg.slurm.spare_nodes if backend == "slurm" else 0,
                heartbeat_timeout_s=cfg.trainer.heartbeat_timeout_s or 0)


def raise_layout(message: str):
    raise ConfigError(message)


RESOLVED_CONFIG = "config.yaml"


def write_resolved_config(cfg, folder: Path) -> Path:
    """The ranks read exactly what was validated, whatever happens to the user's YAML later."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESOLVED_CONFIG
    path.write_text(to_yaml(cfg))
    return path
