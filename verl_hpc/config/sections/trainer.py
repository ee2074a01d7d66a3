"""`trainer:` which program the ranks run and how long; `checkpoint:` when and where it saves."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from verl_hpc.config.fields import WEEK_S, Section, opt, section
from verl_hpc.config.sections.rollback import RollbackConfig


@dataclass
class SmokeConfig(Section):
    """The distributed smoke job; fail_rank/fail_at_step make one rank fail on purpose (tests)."""

    steps: int = opt(3, "steps of the smoke job", check=">0")
    step_seconds: float = opt(0.2, "seconds each step sleeps", check=f"[0, {WEEK_S}]")
    fail_rank: int = opt(-1, ">= 0: this rank fails on purpose at fail_at_step (tests)")
    fail_at_step: int = opt(-1, "the step at which fail_rank fails")
    # exit: the rank dies at once (like a crash); hang: it stops answering collectives (like a
    # wedged GPU or a stuck file system), which only trainer.collective_timeout_s can catch
    fail_mode: str = opt("exit", "exit (dies at once) | hang (stops answering collectives)",
                         choices=("exit", "hang"))
    # off where only torch.distributed's timeout may end a stalled step (an MPI collective has
    # none: a dropped link would hang it for good)
    mpi: bool = opt(True, "also all-reduce over MPI each step (false: torch.distributed only)")

    def check(self, job) -> List[str]:
        p = []
        if self.fail_rank >= max(job.world_size, 1):
            p.append(f"trainer.smoke.fail_rank = {self.fail_rank} is not a rank of this job "
                     f"(world size {job.world_size})")
        if self.fail_rank >= 0 and self.fail_at_step < 0:
            p.append("trainer.smoke.fail_at_step must be >= 0 when trainer.smoke.fail_rank is set")
        return p


@dataclass
class StopAtConfig(Section):
    """Ending a run early on purpose (trainer/hooks/stopping.py): checkpoint, exit 0, a plain log line."""

    metric: str = opt("", "a validation metric (val/..., e.g. val/acc/all) that ends the run once it reaches "
                          "trainer.stop_at.value; '' = off")
    value: Optional[float] = opt(None, "the value trainer.stop_at.metric must reach")
    mode: str = opt("max", "max: stop when metric >= value | min: stop when metric <= value",
                    choices=("max", "min"))
    wall_time_s: float = opt(0.0, "training budget in seconds from the first step: the run stops after the "
                                  "last step that ends within it (0 = off)", check=">=0")

    def check(self, job) -> List[str]:
        p = []
        if self.metric and not self.metric.startswith("val/"):
            p.append(f"trainer.stop_at.metric = '{self.metric}': must be a validation metric (val/acc/<source>, "
                     "val/reward/<source>, e.g. val/acc/all)")
        if self.metric and self.value is None:
            p.append(f"trainer.stop_at.metric = '{self.metric}' needs trainer.stop_at.value")
        if self.value is not None and not self.metric:
            p.append("trainer.stop_at.value is set but trainer.stop_at.metric is empty")
        if self.metric and job.trainer.job == "rl" and not job.trainer.val_every:
            p.append(f"trainer.stop_at.metric = '{self.metric}' needs validation: set trainer.val_every > 0")
        return p


NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def namespaced(path: str, namespace: str) -> str:
    """`<dir>/<name>` -> `<dir>/<namespace>/<name>`; unchanged when the path already has a folder
    named `namespace` (so resolving twice is harmless) or no namespace is set."""
    if not namespace or not path or namespace in Path(path).parts:
        return path
    p = Path(path)
    return str(p.parent / namespace / p.name)


@dataclass
class TrainerConfig(Section):
    job: str = opt("rl", "which program the ranks run", choices=("rl", "sft", "smoke", "dpo"))
    total_steps: int = opt(10, "steps of the run", check=">0")
    project_name: str = opt("verl_hpc", "groups runs in tracking backends")
    experiment_name: str = opt("run", "this run's name")
    namespace: str = opt("", "team/tenant: a folder level in output, checkpoint and Slurm log paths, a prefix of "
                             "the Slurm job name, a label of every Prometheus series; checkpoints of another "
                             "namespace are refused")
    output_dir: str = opt("outputs/${trainer.project_name}/${trainer.experiment_name}",
                          "metrics, plots, logs and (by default) checkpoints")
    val_every: int = opt(0, "steps; 0 = no validation", check=">=0")
    rollout_data_dir: str = opt("", "RL: every step's samples (prompt, response, score; split placement: "
                                "token versions) as <dir>/step_<N>.jsonl; '' = off")
    seed: int = opt(1, "seed of the trainer's own random streams")
    resume: str = opt("auto", "auto (latest checkpoint in checkpoint.dir, if any) | never | a path")
    max_nonfinite_in_a_row: int = opt(3, "non-finite losses tolerated in a row before the job fails", check=">0")
    sft_epochs: int = opt(1, "trainer.job=sft: passes over data.sft_files (total_steps caps the steps)")
    hf_output_dir: str = opt("", "trainer.job=sft: the HF folder RL starts from", auto="<trainer.output_dir>/hf")
    collective_timeout_s: int = opt(600, "a dead rank fails the job after this instead of hanging it",
                                     check=f"(0, {WEEK_S}]")
    stage_timeout_s: int = opt(1800, "a rank this long in one stage outside any collective fails the job, "
                               "naming the rank, the stage and its code line; 0 = no watchdog", check=f"[0, {WEEK_S}]")
    heartbeat_timeout_s: Optional[int] = opt(
        None, "a rank whose heartbeat thread is silent this long (it holds the GIL, is stopped, or its node is "
              "gone) is killed and counts as dead (slurm.max_restarts); below trainer.collective_timeout_s, or "
              "the other ranks' timeout ends the job first; 0 = not watched",
        check=f"[0, {WEEK_S}]", auto="trainer.collective_timeout_s / 2")
    smoke: SmokeConfig = section(SmokeConfig, "the distributed smoke job (trainer.job: smoke)")
    stop_at: StopAtConfig = section(StopAtConfig, "end the RL run early: a validation metric reaches a value, or "
                                                  "a wall-time budget is spent (checkpoint, exit 0)")
    rollback: RollbackConfig = section(RollbackConfig, "roll back to an earlier checkpoint when a watched metric "
                                                       "collapses")

    def check(self, job) -> List[str]:
        p = []
        if self.heartbeat_timeout_s and self.heartbeat_timeout_s >= self.collective_timeout_s:
            p.append(f"trainer.heartbeat_timeout_s = {self.heartbeat_timeout_s} is not below "
                     f"trainer.collective_timeout_s = {self.collective_timeout_s}: the other ranks' collective "
                     "timeout would end the job (not restarted) before a silent rank is found; valid: a value "
                     "below it, or 0 (not watched)")
        if self.resume not in ("auto", "never") and not os.path.exists(self.resume):
            p.append(f"trainer.resume: no such checkpoint '{self.resume}'; valid: auto, never, or an existing path")
        if self.namespace and not NAMESPACE_RE.match(self.namespace):
            p.append(f"trainer.namespace = '{self.namespace}': use 1-63 letters, digits, '_', '.', '-' "
                     "(it becomes a folder name, a Slurm job name and a Prometheus label)")
        return p

    def resolve(self, job) -> None:
        if self.heartbeat_timeout_s is None:
            self.heartbeat_timeout_s = min(self.collective_timeout_s // 2, WEEK_S)  # an out-of-range timeout is its own line
        ns = self.namespace
        if ns and ns not in Path(self.output_dir).parts:
            # paths interpolated from the output folder (slurm.log_dir) move with it; other explicit
            # paths get the namespace folder of their own, so two namespaces never share a file
            old, self.output_dir = self.output_dir, namespaced(self.output_dir, ns)
            moved = lambda path: (self.output_dir + path[len(old):] if path == old or path.startswith(old + "/")
                                  else namespaced(path, ns))
            job.slurm.log_dir = moved(job.slurm.log_dir)
            job.checkpoint.dir = moved(job.checkpoint.dir) if job.checkpoint.dir else ""
            self.hf_output_dir = moved(self.hf_output_dir) if self.hf_output_dir else ""
            self.rollout_data_dir = moved(self.rollout_data_dir) if self.rollout_data_dir else ""
        if ns and not job.slurm.job_name.startswith(f"{ns}-"):
            job.slurm.job_name = f"{ns}-{job.slurm.job_name}"
        self.hf_output_dir = self.hf_output_dir or f"{self.output_dir}/hf"


@dataclass
class CheckpointConfig(Section):
    dir: str = opt("", "checkpoint folder", auto="<trainer.output_dir>/checkpoints")
    save_every: int = opt(0, "steps; 0 = only at the end and on Slurm's warning signal", check=">=0")
    keep_last: int = opt(3, "0 = keep all", check=">=0")
    async_save: bool = opt(False, "write in the background while training goes on")

    def resolve(self, job) -> None:
        self.dir = self.dir or f"{job.trainer.output_dir}/checkpoints"
