"""Non-finite losses and gradient norms: the engines skip such an optimizer step and say so
(`<role>/nonfinite_steps`); the trainer counts steps with any skip and stops the run after
`trainer.max_nonfinite_in_a_row` of them in a row, with a message that says what to look at.
fp16's loss-scale overflows (`<role>/overflow_steps`) are skipped steps too, but ordinary ones (the
scale halves and the next step retries): they do not count towards the limit, and their running
total is `train/overflow_steps_total`."""
from __future__ import annotations

from typing import Dict

from verl_hpc.errors import VerlHpcError


class NonFiniteError(VerlHpcError, RuntimeError):
    """trainer.max_nonfinite_in_a_row steps in a row had a NaN/inf loss or gradient norm."""

    exit_code, kind = 14, "non-finite loss"


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max(1, int(max_in_a_row))
        self.in_a_row = 0
        self.total = 0
        self.overflow_total = 0  # fp16 optimizer steps skipped for a loss-scale overflow

    def state_dict(self) -> Dict[str, int]:
        return {"in_a_row": self.in_a_row, "total": self.total, "overflow_total": self.overflow_total}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])
        self.overflow_total = int(state.get("overflow_total", 0))  # absent in a checkpoint from before fp16

    def check(self, metrics: Dict[str, float], step: int) -> Dict[str, float]:
        """Update the counters from a step's metrics; raise NonFiniteError at the limit."""
        skipped = {k: v for k, v in metrics.items() if k.endswith("/nonfinite_steps") and v > 0}
        if skipped:
            self.in_a_row += 1
            self.total += 1
        else:
            self.in_a_row = 0
        out = {"train/nonfinite_steps_total": float(self.total), "train/nonfinite_in_a_row": float(self.in_a_row)}
        overflows = [v for k, v in metrics.items() if k.endswith("/overflow_steps")]
        if overflows or self.overflow_total:
            self.overflow_total += int(sum(overflows))
            out["train/overflow_steps_total"] = float(self.overflow_total)
        if self.in_a_row >= self.max_in_a_row:
            where = ", ".join(f"{k}={v:g}" for k, v in sorted(skipped.items()))
            raise NonFiniteError(
                f"step {step}: non-finite loss or grad norm in {self.in_a_row} steps in a row ({where}); "
                f"updates were skipped, stopping at trainer.max_nonfinite_in_a_row={self.max_in_a_row}. "
                "Look at the learning rate (actor.optim.lr), actor.optim.clip_grad, the reward scale and "
                "model.dtype; the metrics file has the last finite steps.")
        return out
