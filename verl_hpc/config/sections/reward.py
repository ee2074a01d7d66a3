"""`reward:` how responses are scored."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import WEEK_S, Section, opt, section


@dataclass
class RewardModelConfig(Section):
    enable: bool = opt(False, "score with a reward model")
    path: str = opt("", "reward model folder (a *ForSequenceClassification checkpoint)")

    def check(self, job) -> List[str]:
        if self.enable and not self.path:
            return ["reward.reward_model.path: empty, but reward.reward_model.enable is true"]
        return []


@dataclass
class RewardConfig(Section):
    custom_function: str = opt("", "\"package.module:function\"; needs safety.allow_custom_code")
    on_error: str = opt("zero", "a reward function that fails on one sample", choices=("zero", "raise"))
    gsm8k_method: str = opt("strict", "strict (\"#### 42\") | flexible (last number in the response)",
                            choices=("strict", "flexible"))
    timeout_s: float = opt(120.0, "seconds per reward call (run on a worker thread, so it holds for code that "
                           "ignores signals); a call past it follows on_error; 0 = no limit", check=f"[0, {WEEK_S}]")
    correct_at: float = opt(1.0, "an outcome score at or above this is a correct answer: validation's accuracy, "
                                 "the PRM's 0/1 label and algorithm.accuracy_filter read it")
    reward_model: RewardModelConfig = section(RewardModelConfig)

    def check(self, job) -> List[str]:
        p, fn = [], self.custom_function  # the opt-in is checked by safety: (SafetyConfig)
        module, _, name = fn.partition(":")
        if fn and not (module and name):
            p.append(f"reward.custom_function = '{fn}': expected 'package.module:function'")
        return p
