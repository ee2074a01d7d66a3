"""The implicit PRM's part of the step (PRIME; verl_hpc/algorithms/prime.py, docs/prime.md).

    prm_stage = PrmStage(cfg, roles.prm)
    metrics   = prm_stage(batch, timer)   # fills batch.process_rewards; trains the PRM (prm.update)

After the reference's log-probs (the rewards are log-ratios against them), before the advantages:
1. the PRM's forward on the step's rollouts, as it is before it learns from them: its scores give
   prm/acc, prm/auc and prm/group_auc against the outcome labels (a fair test: it has not seen
   these responses) and, with prm.loss = pairwise, the other-label partners' scores the loss
   compares with;
2. prm.update = before: the update on this batch, then a second forward whose rewards the step
   trains on; after: the rewards of the first forward, then the update; none: a frozen PRM.
"""
from __future__ import annotations

from typing import Dict

import torch

from verl_hpc.algorithms import PrmObjective
from verl_hpc.algorithms.prime import (implicit_scores, implicit_token_rewards, pairwise_partners, prm_metrics,
                                       process_rewards, token_reward_stats)
from verl_hpc.config.errors import ConfigError


class PrmStage:
    def __init__(self, cfg, prm):
        """prm: the ProcessRewardModel role (engines/megatron/roles.py) or anything with its
        log_probs(batch) and update(batch, loss)."""
        self.cfg, self.prm = cfg.prm, prm
        self.objective = PrmObjective.from_config(cfg.prm)

    def _token_rewards(self, batch, timer) -> torch.Tensor:
        with timer("prm"):
            lp = self.prm.log_probs(batch.engine_batch())["prm_log_probs"]
        return implicit_token_rewards(lp, batch.ref_log_probs, batch.mask, self.cfg.beta)

    def __call__(self, batch, timer) -> Dict[str, float]:
        p, labels = self.cfg, batch.outcome_labels
        if batch.ref_log_probs is None:
            raise ConfigError("the implicit PRM needs the reference's log-probs (ref.enable)")
        rewards = self._token_rewards(batch, timer)
        scores = implicit_scores(rewards, batch.mask)
        m = {f"prm/{k}": v for k, v in prm_metrics(scores, labels, batch.group_ids).items()}
        m["prm/score_mean"] = float(scores.mean())
        if p.update != "none":
            data = dict(batch.engine_batch(), outcome_labels=labels)
            if p.loss == "pairwise":
                data["prm_partners"] = pairwise_partners(scores, labels, batch.group_ids)
            with timer("update_prm"):
                m.update(self.prm.update(data, self.objective))
            if p.update == "before":  # the step trains on the updated PRM's rewards
                rewards = self._token_rewards(batch, timer)
        batch.process_rewards = process_rewards(rewards, batch.mask, p.granularity, p.reward_norm)
        m.update({f"prm/{k}": v for k, v in token_reward_stats(rewards, batch.mask).items()})
        return m
