"""Who takes part in a run: the tokenizer, the rollout engine and the engine roles, from config.

    roles = build_roles(cfg, ctx)
    roles.actor, roles.ref, roles.critic, roles.reward_model, roles.rollout, roles.tokenizer

Only what the algorithm needs is built: the reference policy iff a KL term is used
(`ref.enable`, auto), the critic iff the estimator needs values (`critic.enable`, auto: gae), the
reward model iff `reward.reward_model.enable`. Building is collective: every rank calls this.
Megatron is set up first (the engines initialise model parallelism), vLLM after it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Roles:
    tokenizer: Any
    actor: Any
    rollout: Any
    ref: Optional[Any] = None
    critic: Optional[Any] = None
    reward_model: Optional[Any] = None

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))

    def names(self) -> list:
        return [n for n in ("actor", "ref", "critic", "reward_model") if getattr(self, n) is not None]


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer_path,
                                         trust_remote_code=cfg.model.trust_remote_code)


def build_roles(cfg, ctx, *, with_rollout: bool = True) -> Roles:
    from verl_hpc.engines.megatron.roles import build_engine

    tokenizer = load_tokenizer(cfg)
    actor = build_engine("actor", cfg, ctx)
    ref = build_engine("ref", cfg, ctx) if cfg.ref.enable else None
    critic = build_engine("critic", cfg, ctx) if cfg.critic.enable else None
    rm = build_engine("reward", cfg, ctx) if cfg.reward.reward_model.enable else None
    rollout = None
    if with_rollout:
        from verl_hpc.rollout import build_rollout

        rollout = build_rollout(cfg, ctx)
    roles = Roles(tokenizer, actor, rollout, ref, critic, rm)
    if ctx.rank == 0:
        log.info("roles: %s; rollout: %s", ", ".join(roles.names()), cfg.rollout.engine)
    return roles
