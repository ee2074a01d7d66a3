"""`rollout_corr/kl_trend`: the rollout/training mismatch KL of the last steps over that of the run's
first steps, a per-step metric that shows a drift as it builds (docs/quantization.md).

A quantized rollout samples from a policy a little off the trainer's, and the gap need not stay what
it was at the start: verl's MXFP8 study measured the per-tensor FP8 rollout/trainer KL going from
0.0100 to 0.0313 over 32 steps (3.1x) while MXFP8's stayed flat. The step's own KL
(`rollout_corr/kl_k3`, from the old-log-prob pass or the on-policy update's forward) moves with the
batch; the ratio of two window means is steadier: 1.0 is no drift, 3 is verl's case. It is emitted
from the step that fills the first window on; before that there is no baseline. After a resume the
baseline is the first window after it (the windows are not checkpointed).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Dict

from verl_hpc.trainer.hooks.base import CONTINUE, RunState, Verdict

WINDOW = 5  # steps in the baseline and in the recent window
METRIC, TREND = "rollout_corr/kl_k3", "rollout_corr/kl_trend"


class MismatchTrendHook:
    stage = None  # bookkeeping only: nothing here can hang

    def __init__(self, window: int = WINDOW):
        self.window = window
        self.first: list = []
        self.recent: deque = deque(maxlen=window)

    def __call__(self, step: int, metrics: Dict[str, float], run: RunState) -> Verdict:
        value = metrics.get(METRIC)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return CONTINUE  # a step without the measurement (a filtered-out batch, PRIME's warm-up)
        if len(self.first) < self.window:
            self.first.append(float(value))
        self.recent.append(float(value))
        base = sum(self.first) / len(self.first)
        if len(self.first) == self.window and base > 0:
            metrics[TREND] = (sum(self.recent) / len(self.recent)) / base
        return CONTINUE
