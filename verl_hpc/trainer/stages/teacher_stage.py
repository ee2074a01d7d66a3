"""On-policy distillation's part of the step (the `teacher` section; verl_hpc/algorithms/distill.py).

    teacher_stage = TeacherStage(roles.teacher)    # roles.teacher: Teachers (trainer/roles.py build_teachers)
    metrics       = teacher_stage(batch, timer)    # fills batch.teacher_log_probs; teacher/kl

After pi_old's log-probs (teacher/kl compares them with the teacher's) and the reference's, before
the advantages: the advantage stage (reward mode) or the actor's objective (loss mode) reads
batch.teacher_log_probs.

Several teachers (teacher.by_data_source): each row is scored by its data_source's teacher
(teacher.model_path for sources not listed); each teacher's forward runs on its rows only, in the
order of the folders, alike on every rank (every rank holds the same global batch). A source with
no teacher is refused before the first step (`Teachers.check_sources`).

`TeacherRecord` is the teachers' entry in a checkpoint: frozen, their weights are never saved; the
checkpoint names each folder by path and fingerprint (as a LoRA checkpoint names its base,
verl_hpc/checkpoint/base_model.py), and a resume with a teacher whose files differ is refused: the
resumed run would not be the run that saved.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch

from verl_hpc.algorithms.distill import teacher_metrics
from verl_hpc.checkpoint.base_model import base_fingerprint
from verl_hpc.checkpoint.errors import CheckpointMismatchError
from verl_hpc.config.errors import ConfigError


class Teachers:
    """The teacher roles by folder, and which rows each scores (teacher.by_data_source, else
    teacher.model_path)."""

    def __init__(self, roles: Dict[str, object], teacher_cfg):
        """roles: folder -> Teacher role (verl_hpc/engines/roles.py) or anything with its
        log_probs(batch); teacher_cfg: the teacher section."""
        self.roles, self.cfg = dict(roles), teacher_cfg

    @property
    def multi(self) -> bool:
        return bool(self.cfg.by_data_source)

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Refuse data whose sources some row has no teacher for (one line, before any step)."""
        missing = sorted({s for s in data_sources if not self.cfg.folder_of(s)})
        if missing:
            listed = ", ".join(sorted(self.cfg.by_data_source))
            raise ConfigError(f"teacher.by_data_source: no teacher for data_source {', '.join(map(repr, missing))} "
                              f"(listed: {listed}) and teacher.model_path is empty; add them or set "
                              "teacher.model_path as the teacher of the rest")

    def rows_by_folder(self, data_sources: List[str]) -> Dict[str, List[int]]:
        out: Dict[str, List[int]] = {f: [] for f in self.roles}
        for i, s in enumerate(data_sources):
            folder = self.cfg.folder_of(s)
            if folder not in out:
                raise ConfigError(f"data_source {s!r} has no teacher (teacher.by_data_source, teacher.model_path)")
            out[folder].append(i)
        return out

    def log_probs(self, batch) -> Dict[str, torch.Tensor]:
        """{"teacher_log_probs": [B, T]}: each row's log-probs under its own teacher (`batch`: the
        step's StepBatch, whose data_sources route the rows)."""
        if len(self.roles) == 1:  # one teacher scores every row: the whole batch in one forward
            return next(iter(self.roles.values())).log_probs(batch)
        mask = batch.response_mask
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        for folder, rows in self.rows_by_folder(batch.data_sources).items():
            if not rows:  # the same on every rank: the batch is global
                continue
            keep = torch.zeros(len(batch), dtype=torch.bool)
            keep[rows] = True
            lp = self.roles[folder].log_probs(batch.select(keep))["teacher_log_probs"]
            out = out.to(lp.dtype)
            out[rows, : lp.shape[1]] = lp[:, : out.shape[1]]
        return {"teacher_log_probs": out}


class TeacherStage:
    def __init__(self, teachers: Teachers):
        self.teachers = teachers

    def __call__(self, batch, timer) -> Dict[str, float]:
        with timer("teacher"):
            batch.fill(self.teachers.log_probs(batch))  # teacher_log_probs
        m = {f"teacher/{k}": v for k, v in teacher_metrics(batch.old_log_probs, batch.teacher_log_probs,
                                                               batch.mask).items()}
        if self.teachers.multi:  # teacher/kl/<data_source>: how far the student is from each teacher
            for source in sorted(set(batch.data_sources)):
                rows = [i for i, s in enumerate(batch.data_sources) if s == source]
                m[f"teacher/kl/{source}"] = teacher_metrics(batch.old_log_probs[rows], batch.teacher_log_probs[rows],
                                                            batch.mask[rows])["kl"]
        return m


class TeacherRecord:
    """The checkpoint's record of the frozen teachers (a `states` entry of the checkpointer):
    {field: {"path", "fingerprint"}} for teacher.model_path and each teacher.by_data_source entry."""

    def __init__(self, teacher_cfg):
        self.folders = teacher_cfg.folders()

    def state_dict(self) -> dict:
        return {field: {"path": path, "fingerprint": base_fingerprint(path)} for field, path in self.folders.items()}

    def load_state_dict(self, saved: dict) -> None:
        for field, record in saved.items():
            path = self.folders.get(field)
            if path is None:  # that teacher is no longer used: nothing it scores
                continue
            mine = base_fingerprint(path)
            if record["fingerprint"] != mine:
                raise CheckpointMismatchError(
                    f"the checkpoint was trained with the teacher at {record['path']}, whose files differ from "
                    f"{field} = {path} (fingerprints {record['fingerprint'][:12]} vs {mine[:12]}): point {field} "
                    "at that teacher, or start afresh (trainer.resume=never)")
