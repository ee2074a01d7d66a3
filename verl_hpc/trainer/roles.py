"""Who takes part in a run: the tokenizer, the rollout engine and the engine roles, from config.

    roles = build_roles(cfg, ctx)
    roles.actor, roles.ref, roles.critic, roles.reward_model, roles.prm, roles.rollout, roles.tokenizer

Only what the algorithm needs is built: the reference policy iff a KL term or the implicit PRM
uses it (`ref.enable`, auto), the critic iff the estimator needs values (`critic.enable`, auto:
gae), the reward model iff `reward.reward_model.enable`, PRIME's implicit PRM iff `prm.enable`
(auto: the prime estimator). Building is collective: every rank calls this.

Order: multi_turn's chat template, tools and environment first (verl_hpc/rollout/agent.py): a job
whose tools cannot load fails in seconds, before any engine, and with no vLLM engine whose exit
path could print after the `error:` line. Then the rollout engine, then put to sleep, then the
Megatron engines. On GPU vLLM refuses
to start unless the free memory is at least `rollout.gpu_memory_utilization` x the GPU's total
(its start-up check counts memory other libraries hold as used), so it must start before the
training engines take theirs; with `rollout.sleep_between_phases` its sleep then hands its memory
to them. The trainer wakes it and loads the actor's weights before the first generate. Megatron's
and vLLM's process groups coexist in either order (both are created collectively, alike on every
rank).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Optional

from verl_hpc.engines.megatron.roles import build_engine, build_reference

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Roles:
    tokenizer: Any
    actor: Any
    rollout: Any
    ref: Optional[Any] = None
    critic: Optional[Any] = None
    reward_model: Optional[Any] = None
    prm: Optional[Any] = None  # PRIME's implicit process reward model (trained online)
    episodes: Optional[Any] = None  # multi_turn: the EpisodeRunner over `rollout` (verl_hpc/rollout/episodes.py)
    # every generation's result is handed to this before anyone uses it: the trainer sets the
    # weight step's check (LoRA: the adapter version it used, resharding/adapter_sync.py)
    verify: Callable[[Any], None] = lambda result: None

    def generate(self, prompts, spec):
        """The rollout of a PromptBatch: episodes under multi_turn, else one response per sample."""
        if self.episodes is None:
            result = self.rollout.generate(prompts.prompt_ids, spec)
        else:
            result = self.episodes.generate(prompts.prompt_ids, spec, rows=prompts.extras,
                                            offered=[x.get("tools") for x in prompts.extras])
        self.verify(result)
        return result

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    def trained_engines(self) -> dict:
        """The engines a checkpoint holds, by role name: the actor, (PPO) the critic and (PRIME) the
        implicit PRM when it trains. The reference, a reward model and a frozen PRM (prm.update =
        none, no optimizer) are not trained and are rebuilt from their folders."""
        out = {"actor": self.actor.engine}
        if self.critic is not None:
            out["critic"] = self.critic.engine
        if self.prm is not None and getattr(self.prm.engine, "optimizer", None) is not None:
            out["prm"] = self.prm.engine
        return out

    def names(self) -> list:
        return [n for n in ("actor", "ref", "critic", "reward_model", "prm") if getattr(self, n) is not None]


def pad_token_id(tokenizer) -> int:
    """The id padded rows hold, for every program: the tokenizer's pad token, else its EOS, else 0
    (never trained on: the masks leave padding out)."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    return int(pad if pad is not None else 0)


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer_path,
                                         trust_remote_code=cfg.model.trust_remote_code)


def build_roles(cfg, ctx, *, with_rollout: bool = True) -> Roles:
    """The caller owns the returned rollout engine and episode runner and closes them (`with
    roles.rollout:`, `with roles.episodes:`); if a role built after them fails, they are closed
    here before the error goes on."""
    tokenizer = load_tokenizer(cfg)
    rollout, parts, episodes = None, None, None
    with contextlib.ExitStack() as on_error:
        if with_rollout and cfg.multi_turn.enable:  # first: what fails here fails before any engine loads
            from verl_hpc.rollout.agent import episode_parts

            parts = episode_parts(cfg, ctx, tokenizer)
            on_error.callback(parts[1].close)  # its tool workers and sandbox
        if with_rollout:
            from verl_hpc.rollout import build_rollout

            rollout = on_error.enter_context(build_rollout(cfg, ctx))
            rollout.sleep()  # rollout.sleep_between_phases: its memory goes to the engines built next
        actor = build_engine("actor", cfg, ctx)
        ref = build_reference(cfg, ctx, actor, build_engine) if cfg.ref.enable else None
        critic = build_engine("critic", cfg, ctx) if cfg.critic.enable else None
        rm = build_engine("reward", cfg, ctx) if cfg.reward.reward_model.enable else None
        prm = build_engine("prm", cfg, ctx) if cfg.trainer.job == "rl" and cfg.prm.enable else None
        if parts is not None:
            from verl_hpc.rollout.agent import build_episode_runner

            episodes = build_episode_runner(cfg, ctx, rollout, parts)
        on_error.pop_all()  # all built: the engine (and the episode runner) stay open for the caller
    roles = Roles(tokenizer, actor, rollout, ref, critic, rm, prm=prm, episodes=episodes)
    if ctx.rank == 0:
        lora = cfg.lora
        log.info("roles: %s; rollout: %s%s", ", ".join(roles.names()), cfg.rollout.engine,
                 f"; LoRA rank {lora.rank} on {', '.join(lora.target_modules)} (the base frozen"
                 f"{'; ref = the base, adapters off' if roles.ref is not None else ''})" if lora.enabled else "")
    return roles
