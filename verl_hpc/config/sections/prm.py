"""`prm:` the implicit process reward model of PRIME (Cui et al. 2025), trained online.

The PRM is a causal LM like the policy (by default a copy of the actor's starting model). Its dense
reward for response token t is r_t = beta * (log pi_prm(y_t | y_<t) - log pi_ref(y_t | y_<t)), with
pi_ref the policy's reference model (no second copy); the sum over the response is its implicit
outcome score. Each step it is trained on that step's rollouts against the verifier's 0/1 outcome
labels (reward.correct_at), so no reward-model training stage comes first. docs/prime.md has the
formulas and the step.

The PRM is a Megatron engine on the training ranks, in the training layout (parallel.*: Megatron's
model-parallel groups are one per process, shared by every role), with its own optimizer, batching
and offload switches; checkpoints hold it beside the actor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from verl_hpc.config.fields import Section, opt, section
from verl_hpc.config.sections.roles import OptimConfig, TrainedRole

PRM_LOSSES = ("ce", "pairwise")
PRM_UPDATES = ("before", "after", "none")
PRM_GRANULARITIES = ("token", "whole")
PRM_REWARD_NORMS = ("batch_norm", "none")
PRM_PROCESS_LOO = ("others", "verl")  # the prime estimator's baselines (algorithms/prime.py)


@dataclass
class PrmConfig(TrainedRole):
    name = "prm"
    enable: Optional[bool] = opt(None, "the implicit process reward model", auto="on iff algorithm.adv_estimator "
                                                                                 "is prime")
    model_path: str = opt("", "the model the PRM starts from (the SFT model, typically)", auto="model.path")
    beta: float = opt(0.05, "r_t = beta * (log pi_prm - log pi_ref): scales the rewards and the loss's logit",
                      check=">0")
    loss: str = opt("ce", "ce: cross-entropy of sigmoid(summed score) against the 0/1 outcome label | pairwise: "
                          "-log sigmoid(+-(score - mean score of the group's responses with the other label)), "
                          "the others' scores taken before the update", choices=PRM_LOSSES)
    update: str = opt("before", "when the PRM trains on the step's rollouts: before (the rewards come from the "
                                "updated PRM) | after (from the PRM as it was; then it trains) | none (frozen)",
                      choices=PRM_UPDATES)
    warmup_steps: int = opt(0, "first steps in which only the PRM trains (the actor waits)", check=">=0")
    granularity: str = opt("token", "token: r_t on every response token | whole: their sum on the last token",
                           choices=PRM_GRANULARITIES)
    reward_norm: str = opt("batch_norm", "batch_norm: divide the rewards by the largest |reward-to-go| of the "
                                         "batch (process returns in [-1, 1]) | none", choices=PRM_REWARD_NORMS)
    process_coef: float = opt(5.0, "weight of the process rewards in the step's rewards", check=">=0")
    outcome_coef: float = opt(5.0, "weight of the outcome (verifier) rewards beside them", check=">=0")
    process_loo: str = opt("others", "the prime estimator's process baseline: others: r_t minus the other responses' "
                                     "mean token reward | verl: verl's recipe's per-token form, which also scales "
                                     "r_t's deviation from its row mean by n/(n-1) (docs/prime.md, Conventions)",
                           choices=PRM_PROCESS_LOO)
    optim: OptimConfig = section(lambda: OptimConfig(lr=1e-6), "lr defaults to 1e-6")

    @staticmethod
    def wanted(job) -> bool:
        """On iff asked for, or (auto) when the estimator is PRIME's."""
        enable = job.prm.enable
        return enable if enable is not None else job.algorithm.adv_estimator == "prime"

    def check(self, job) -> List[str]:
        if job.trainer.job != "rl":
            return []
        p, on = [], self.wanted(job)
        if self.enable is False and job.algorithm.adv_estimator == "prime":
            p.append("prm.enable = false, but algorithm.adv_estimator = prime combines the PRM's process "
                     "rewards with the outcome: set prm.enable=true (or leave it null) or pick another estimator")
        if not on:
            return p
        if self.process_coef == 0 and self.outcome_coef == 0:
            p.append("prm.process_coef and prm.outcome_coef are both 0: the step's rewards would be 0")
        if self.warmup_steps and self.update == "none":
            p.append("prm.warmup_steps trains the PRM alone, but prm.update = none freezes it")
        if self.loss == "pairwise" and job.rollout.n < 2:
            p.append(f"prm.loss = pairwise compares responses to one prompt and needs rollout.n >= 2 "
                     f"(got {job.rollout.n})")
        return p + self.batch_problems(job)

    def resolve(self, job) -> None:
        self.model_path = self.model_path or job.model.path
        self.enable = self.wanted(job)
