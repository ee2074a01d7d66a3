"""`data.tasks` and `data.task_weights`: several named tasks trained at once, with weights that may adapt.

    data:
      tasks:
        easy: {train_files: [easy/train.parquet], val_files: [easy/val.parquet], weight: 1.0}
        hard: {train_files: [hard/train.parquet], val_files: [hard/val.parquet], weight: 1.0,
               data_source: synthetic_arith}
      task_weights: {schedule: plateau, metric: reward, patience: 5, min_weight: 0.1}

A task's rows keep the files' data_source (which picks the reward rule) unless the task names one.
The task entries stay plain mappings in the job config (a mapping of sections has no place in the
dataclass tree the loader builds); `task_specs(data_cfg)` turns them into TaskConfig objects.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List

from verl_hpc.config.fields import Section, opt

TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # a metric-name component and a label
SCHEDULES = ("fixed", "plateau")
TASK_METRICS = ("reward", "acc", "val_reward", "val_acc")


@dataclass
class TaskConfig(Section):
    train_files: List[str] = opt([], "parquet / jsonl prompt files of this task")
    val_files: List[str] = opt([], "held-out prompts of this task (val/task/<name>/* metrics)")
    weight: float = opt(1.0, "sampling weight (share of each batch = weight / sum of weights)")
    data_source: str = opt("", "data_source for every row (routes the reward rule); empty: the files' column")


@dataclass
class TaskWeightsConfig(Section):
    schedule: str = opt("fixed", "fixed: the tasks' weights throughout | plateau: lower saturated or "
                                 "non-improving tasks, give their share to the others", choices=SCHEDULES)
    metric: str = opt("reward", "per-task metric watched: reward/acc (training batch, every step) or "
                                "val_reward/val_acc (every trainer.val_every steps)", choices=TASK_METRICS)
    patience: int = opt(5, "observations of the metric without an improvement of min_delta (or at/above "
                           "saturation) before a task's weight is lowered", check=">0")
    min_delta: float = opt(0.01, "an improvement smaller than this does not count", check=">=0")
    saturation: float = opt(0.95, "a metric at or above this counts as saturated")
    decay: float = opt(0.5, "a lowered weight is multiplied by this (never below min_weight)", check="(0, 1)")
    min_weight: float = opt(0.1, "no task's weight goes below this", check=">=0")


def task_specs(data_cfg) -> Dict[str, TaskConfig]:
    """{name: TaskConfig} of data.tasks, in name order (the order every rank and resume sees)."""
    return {name: TaskConfig(**dict(data_cfg.tasks[name])) for name in sorted(data_cfg.tasks)}


def task_problems(job) -> List[str]:
    """data.tasks / data.task_weights rules (called from DataConfig.check)."""
    d, p = job.data, []
    if not d.tasks:
        if d.task_weights.schedule != "fixed":
            p.append(f"data.task_weights.schedule = {d.task_weights.schedule}: needs data.tasks")
        return p
    for key in ("train_files", "val_files"):
        if getattr(d, key):
            p.append(f"data.{key} and data.tasks are both set: move the files under "
                     f"data.tasks.<name>.{key} (each task has its own)")
    if d.mixture:
        p.append("data.mixture and data.tasks are both set: data.tasks replaces data.mixture; give each "
                 "data_source a task with its weight (data.tasks.<name>.weight)")
    specs = task_specs(d)
    for name, t in specs.items():
        if not TASK_NAME.match(name):
            p.append(f"data.tasks.{name}: a task name is 1-63 letters, digits, '_', '.', '-' "
                     "(it becomes part of metric names)")
        if not t.train_files and job.trainer.job == "rl":
            p.append(f"data.tasks.{name}.train_files: empty; each task needs at least one prompt file")
        if not (t.weight >= 0 and math.isfinite(t.weight)):
            p.append(f"data.tasks.{name}.weight: must be >= 0, got {t.weight}")
    if sum(t.weight for t in specs.values()) <= 0:
        p.append(f"data.tasks: the weights must have a positive sum, got "
                 f"{ {n: t.weight for n, t in specs.items()} }")
    tw = d.task_weights
    if tw.schedule != "fixed":
        low = sorted(n for n, t in specs.items() if 0 < t.weight < tw.min_weight)
        if low:
            p.append(f"data.task_weights.min_weight = {tw.min_weight} is above the weight of task(s) {low}; "
                     "lower min_weight or raise their data.tasks.<name>.weight")
        if tw.metric.startswith("val_") and not job.trainer.val_every:
            p.append(f"data.task_weights.metric = {tw.metric} needs validation: set trainer.val_every > 0")
        if tw.metric.startswith("val_"):
            missing = sorted(n for n, t in specs.items() if not t.val_files)
            if missing:
                p.append(f"data.task_weights.metric = {tw.metric}: task(s) {missing} have no val_files")
    return p
