"""The reward model's entry in a checkpoint: frozen (scorer or judge), its weights are never saved;
the checkpoint names its folder by path, kind and fingerprint (as a LoRA checkpoint names its base,
verl_hpc/checkpoint/base_model.py, and as the teacher is named), and a resume with a reward model
whose files differ is refused: the resumed run's rewards would not be the ones that trained it."""
from __future__ import annotations

from verl_hpc.checkpoint.base_model import base_fingerprint
from verl_hpc.checkpoint.errors import CheckpointMismatchError

FIELD = "reward.reward_model.path"


class RewardModelRecord:
    """A `states` entry of the checkpointer; also carries the judge's run total of failed verdicts
    (judge/failures_total goes on across a resume)."""

    def __init__(self, rm_cfg, model=None):
        self.path, self.kind, self.model = rm_cfg.path, rm_cfg.kind, model

    def state_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "fingerprint": base_fingerprint(self.path),
                "failures_total": int(getattr(self.model, "failures_total", 0))}

    def load_state_dict(self, saved: dict) -> None:
        mine = base_fingerprint(self.path)
        if saved["fingerprint"] != mine:
            raise CheckpointMismatchError(
                f"the checkpoint was trained with the reward model ({saved['kind']}) at {saved['path']}, whose "
                f"files differ from {FIELD} = {self.path} (fingerprints {saved['fingerprint'][:12]} vs "
                f"{mine[:12]}): point {FIELD} at that model, or start afresh (trainer.resume=never)")
        if self.model is not None and hasattr(self.model, "failures_total"):
            self.model.failures_total = int(saved.get("failures_total", 0))
