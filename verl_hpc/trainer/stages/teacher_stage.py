"""On-policy distillation's part of the step (the `teacher` section; verl_hpc/algorithms/distill.py).

    teacher_stage = TeacherStage(roles.teacher)
    metrics       = teacher_stage(batch, timer)    # fills batch.teacher_log_probs; teacher/kl

After pi_old's log-probs (teacher/kl compares them with the teacher's) and the reference's, before
the advantages: the advantage stage (reward mode) or the actor's objective (loss mode) reads
batch.teacher_log_probs.

`TeacherRecord` is the teacher's entry in a checkpoint: frozen, its weights are never saved; the
checkpoint names its folder by path and fingerprint (as a LoRA checkpoint names its base,
verl_hpc/checkpoint/base_model.py), and a resume with a teacher whose files differ is refused: the
resumed run would not be the run that saved.
"""
from __future__ import annotations

from typing import Dict

from verl_hpc.algorithms.distill import teacher_metrics
from verl_hpc.checkpoint.base_model import base_fingerprint
from verl_hpc.checkpoint.errors import CheckpointMismatchError


class TeacherStage:
    def __init__(self, teacher):
        """teacher: the Teacher role (verl_hpc/engines/roles.py) or anything with its log_probs(batch)."""
        self.teacher = teacher

    def __call__(self, batch, timer) -> Dict[str, float]:
        with timer("teacher"):
            batch.fill(self.teacher.log_probs(batch))  # teacher_log_probs
        m = teacher_metrics(batch.old_log_probs, batch.teacher_log_probs, batch.mask)
        return {f"teacher/{k}": v for k, v in m.items()}


class TeacherRecord:
    """The checkpoint's record of the frozen teacher (a `states` entry of the checkpointer)."""

    def __init__(self, model_path: str):
        self.path = str(model_path)

    def state_dict(self) -> dict:
        return {"path": self.path, "fingerprint": base_fingerprint(self.path)}

    def load_state_dict(self, saved: dict) -> None:
        mine = base_fingerprint(self.path)
        if saved["fingerprint"] != mine:
            raise CheckpointMismatchError(
                f"the checkpoint was trained with the teacher at {saved['path']}, whose files differ from "
                f"teacher.model_path = {self.path} (fingerprints {saved['fingerprint'][:12]} vs {mine[:12]}): "
                "point teacher.model_path at that teacher, or start afresh (trainer.resume=never)")
