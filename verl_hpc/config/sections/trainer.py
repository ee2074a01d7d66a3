"""`trainer:` which program the ranks run and how long; `checkpoint:` when and where it saves."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import Section, opt, section


@dataclass
class SmokeConfig(Section):
    """The distributed smoke job; fail_rank/fail_at_step make one rank fail on purpose (tests)."""

    steps: int = opt(3, "steps of the smoke job", check=">0")
    step_seconds: float = opt(0.2, "seconds each step sleeps", check=">=0")
    fail_rank: int = opt(-1, ">= 0: this rank fails on purpose at fail_at_step (tests)")
    fail_at_step: int = opt(-1, "the step at which fail_rank fails")
    # exit: the rank dies at once (like a crash); hang: it stops answering collectives (like a
    # wedged GPU or a stuck file system), which only trainer.collective_timeout_s can catch
    fail_mode: str = opt("exit", "exit (dies at once) | hang (stops answering collectives)",
                         choices=("exit", "hang"))

    def check(self, job) -> List[str]:
        p = []
        if self.fail_rank >= max(job.world_size, 1):
            p.append(f"trainer.smoke.fail_rank = {self.fail_rank} is not a rank of this job "
                     f"(world size {job.world_size})")
        if self.fail_rank >= 0 and self.fail_at_step < 0:
            p.append("trainer.smoke.fail_at_step must be >= 0 when trainer.smoke.fail_rank is set")
        return p


@dataclass
class TrainerConfig(Section):
    job: str = opt("rl", "which program the ranks run", choices=("rl", "sft", "smoke"))
    total_steps: int = opt(10, "steps of the run", check=">0")
    project_name: str = opt("verl_hpc", "groups runs in tracking backends")
    experiment_name: str = opt("run", "this run's name")
    output_dir: str = opt("outputs/${trainer.project_name}/${trainer.experiment_name}",
                          "metrics, plots, logs and (by default) checkpoints")
    val_every: int = opt(0, "steps; 0 = no validation", check=">=0")
    seed: int = opt(1, "seed of the trainer's own random streams")
    resume: str = opt("auto", "auto (latest checkpoint in checkpoint.dir, if any) | never | a path")
    max_nonfinite_in_a_row: int = opt(3, "non-finite losses tolerated in a row before the job fails", check=">0")
    sft_epochs: int = opt(1, "trainer.job=sft: passes over data.sft_files (total_steps caps the steps)")
    hf_output_dir: str = opt("", "trainer.job=sft: the HF folder RL starts from", auto="<trainer.output_dir>/hf")
    inject_nan_at_steps: List[int] = opt([], "tests only: RL steps whose loss is made NaN")
    collective_timeout_s: int = opt(600, "a dead rank fails the job after this instead of hanging it", check=">0")
    stage_timeout_s: int = opt(1800, "a rank this long in one stage outside any collective fails the job, "
                               "naming the rank, the stage and its code line; 0 = no watchdog", check=">=0")
    smoke: SmokeConfig = section(SmokeConfig, "the distributed smoke job (trainer.job: smoke)")

    def check(self, job) -> List[str]:
        if self.resume not in ("auto", "never") and not os.path.exists(self.resume):
            return [f"trainer.resume: no such checkpoint '{self.resume}'; valid: auto, never, or an existing path"]
        return []

    def resolve(self, job) -> None:
        self.hf_output_dir = self.hf_output_dir or f"{self.output_dir}/hf"


@dataclass
class CheckpointConfig(Section):
    dir: str = opt("", "checkpoint folder", auto="<trainer.output_dir>/checkpoints")
    save_every: int = opt(0, "steps; 0 = only at the end and on Slurm's warning signal", check=">=0")
    keep_last: int = opt(3, "0 = keep all", check=">=0")
    async_save: bool = opt(False, "write in the background while training goes on")

    def resolve(self, job) -> None:
        self.dir = self.dir or f"{job.trainer.output_dir}/checkpoints"
