"""The four roles of the RL step on top of `MegatronEngine`, and `build_engine(role, cfg, ctx)`.

    actor  = build_engine("actor", cfg, ctx)     # Actor:       log_probs(batch), update(batch)
    ref    = build_engine("ref", cfg, ctx)       # Reference:   log_probs(batch)
    critic = build_engine("critic", cfg, ctx)    # Critic:      values(batch), update(batch)
    rm     = build_engine("reward", cfg, ctx)    # RewardModel: score(batch)

Batch keys the roles read besides the sequence keys (engines/batch.py), all `[B, T]`:
actor.update: old_log_probs, advantages, and ref_log_probs when actor.use_kl_loss;
critic.update: values (the critic's at rollout time), returns.

An update runs `ppo_epochs` passes over consecutive mini-batches of `ppo_mini_batch_size` prompts
(x rollout.n sequences), one optimizer step each, then advances the LR schedule by one trainer
step. Metrics are means over the optimizer steps, prefixed with the role ("actor/pg_loss",
"actor/lr" = the LR these steps used);
`<role>/nonfinite_steps` counts skipped steps (the trainer decides what to do about them).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import torch

from verl_hpc.engines.base import GlobalCounts
from verl_hpc.engines.batch import Batch, split_rows
from verl_hpc.engines.megatron.engine import EngineOptions, MegatronEngine

ROLES = ("actor", "critic", "ref", "reward")


def take_rows(batch: Mapping[str, torch.Tensor], rows: List[int]) -> Batch:
    """Rows of every per-row tensor (widths unchanged)."""
    b = batch["input_ids"].shape[0]
    idx = torch.as_tensor(rows, dtype=torch.long)
    return {k: v[idx] for k, v in batch.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b}


def _mean_metrics(steps: List[Dict[str, float]], prefix: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for key in sorted({k for m in steps for k in m}):
        vals = [m[key] for m in steps if key in m]
        out[f"{prefix}/{key}"] = sum(vals) / len(vals)
    out[f"{prefix}/nonfinite_steps"] = float(sum(m.get("nonfinite", 0.0) for m in steps))
    out.pop(f"{prefix}/nonfinite", None)
    return out


class _Trainable:
    prefix = ""

    def __init__(self, engine: MegatronEngine, role_cfg, n: int = 1):
        self.engine, self.cfg, self.n = engine, role_cfg, max(1, n)

    def loss_fn(self, out, mb, counts: GlobalCounts):
        raise NotImplementedError

    outputs = ("log_probs",)

    def update(self, batch: Mapping[str, torch.Tensor]) -> Dict[str, float]:
        size = self.cfg.ppo_mini_batch_size * self.n
        if size < 1:
            raise ValueError(f"{self.prefix}.ppo_mini_batch_size must be >= 1")
        steps = []
        for _ in range(self.cfg.ppo_epochs):
            for rows in split_rows(batch["input_ids"].shape[0], size):
                steps.append(self.engine.train_step(take_rows(batch, rows), self.loss_fn, self.outputs))
        metrics = _mean_metrics(steps, self.prefix)  # <role>/lr: the LR this update used
        self.engine.scheduler_step()
        return metrics


class Actor(_Trainable):
    """PPO-family policy update: policy loss (actor.policy_loss) + optional KL loss
    (actor.use_kl_loss) - entropy_coeff * entropy, all aggregated with actor.loss_agg_mode."""

    prefix = "actor"

    def __init__(self, engine, role_cfg, n: int = 1):
        super().__init__(engine, role_cfg, n)
        self.outputs = ("log_probs", "entropy") if role_cfg.entropy_coeff else ("log_probs",)

    def log_probs(self, batch) -> Dict[str, torch.Tensor]:
        out = self.engine.forward(batch, ("log_probs", "entropy"))
        return {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}

    def loss_fn(self, out, mb, counts: GlobalCounts):
        from verl_hpc.algorithms import agg_loss, compute_policy_loss, kl_loss

        c = self.cfg
        mask = mb["response_mask"]
        agg = dict(loss_agg_mode=c.loss_agg_mode, **counts.agg_kwargs())
        loss, metrics = compute_policy_loss(
            c.policy_loss, mb["old_log_probs"], out["log_probs"], mb["advantages"], mask,
            clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high,
            clip_ratio_c=c.clip_ratio_c, **agg)
        metrics = dict(metrics, pg_loss=loss.detach())
        if c.entropy_coeff:
            ent = agg_loss(out["entropy"], mask, c.loss_agg_mode, counts.tokens, counts.seqs,
                           counts.norm_len)
            loss = loss - c.entropy_coeff * ent
            metrics["entropy_loss"] = ent.detach()
        if c.use_kl_loss:
            if "ref_log_probs" not in mb:
                raise ValueError("actor.use_kl_loss=true but the batch has no 'ref_log_probs'")
            kl, kl_metrics = kl_loss(out["log_probs"], mb["ref_log_probs"], mask, c.kl_loss_coef,
                                     c.kl_loss_type, **agg)
            loss = loss + kl
            metrics["kl_loss"] = kl_metrics["kl_loss"]
        # pg_loss / entropy_loss / kl_loss are this micro-batch's contributions; x tokens/mb_tokens
        # makes the engine's token-weighted mean their sum, i.e. the whole batch's value.
        scale = counts.tokens / max(float(mask.sum()), 1.0)
        for key in ("pg_loss", "entropy_loss", "kl_loss"):
            if key in metrics:
                metrics[key] = metrics[key] * scale
        return loss, metrics


class Critic(_Trainable):
    """Value regression with PPO value clipping (critic.cliprange_value, critic.loss_agg_mode)."""

    prefix = "critic"
    outputs = ("values",)

    def values(self, batch) -> Dict[str, torch.Tensor]:
        return {"values": self.engine.forward(batch, ("values",))["values"]}

    def loss_fn(self, out, mb, counts: GlobalCounts):
        from verl_hpc.algorithms import value_loss

        c = self.cfg
        loss, metrics = value_loss(out["values"], mb["values"], mb["returns"], mb["response_mask"],
                                   cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                                   **counts.agg_kwargs())
        scale = counts.tokens / max(float(mb["response_mask"].sum()), 1.0)
        return loss, dict(metrics, vf_loss=loss.detach() * scale)


class Reference:
    """Frozen copy of the initial policy: no optimizer, no gradients, forward only."""

    def __init__(self, engine: MegatronEngine):
        self.engine = engine

    def log_probs(self, batch) -> Dict[str, torch.Tensor]:
        return {"ref_log_probs": self.engine.forward(batch, ("log_probs",))["log_probs"]}


class RewardModel:
    """Frozen value-head model: one score per sequence, from its last token."""

    def __init__(self, engine: MegatronEngine):
        self.engine = engine

    def score(self, batch) -> Dict[str, torch.Tensor]:
        out = self.engine.forward(batch, ("scores", "token_scores"))
        return {"rm_scores": out["scores"], "rm_token_scores": out["token_scores"]}


def engine_options(role: str, cfg, *, fp8: bool = False, loss_norm_len: Optional[float] = None,
                   total_steps: Optional[int] = None) -> EngineOptions:
    """EngineOptions for a role from the job config (JobConfig)."""
    if role not in ROLES:
        raise ValueError(f"engine role {role!r}; valid: {', '.join(ROLES)}")
    common = dict(dtype=cfg.model.dtype, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                  sequence_parallel=cfg.parallel.sequence_parallel, fp8=fp8,
                  total_steps=total_steps or cfg.trainer.total_steps, loss_norm_len=loss_norm_len)
    if role in ("actor", "ref"):
        a = cfg.actor
        return EngineOptions(model_path=cfg.model.path, head="lm", trainable=role == "actor",
                             optim=a.optim if role == "actor" else None,
                             micro_batch_size=a.micro_batch_size,
                             max_tokens_per_microbatch=a.max_tokens_per_microbatch,
                             temperature=cfg.rollout.temperature, **common)
    if role == "critic":
        c = cfg.critic
        return EngineOptions(model_path=c.model_path, head="value", optim=c.optim,
                             micro_batch_size=c.micro_batch_size,
                             max_tokens_per_microbatch=c.max_tokens_per_microbatch, **common)
    rm = cfg.reward.reward_model
    if not rm.path:
        raise ValueError("reward.reward_model.path: empty; a reward-model role needs a model folder")
    return EngineOptions(model_path=rm.path, head="value", trainable=False,
                         micro_batch_size=cfg.actor.micro_batch_size,
                         max_tokens_per_microbatch=cfg.actor.max_tokens_per_microbatch, **common)


def build_engine(role: str, cfg, ctx=None, **kwargs):
    """The role object for `role` in {actor, critic, ref, reward}; initialises Megatron model
    parallelism from cfg.parallel if nobody has yet (collective: call on every rank).
    ctx: the rank's RankContext (verl_hpc.runtime.bootstrap), which must exist: the engine lives
    on its default process group. kwargs: fp8, loss_norm_len, total_steps (see engine_options)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from verl_hpc.parallel import init_from_config

    if not dist.is_initialized():
        raise RuntimeError("build_engine needs the rank runtime: call verl_hpc.runtime.bootstrap()")
    if not ps.model_parallel_is_initialized():
        init_from_config(cfg.parallel, seed=cfg.trainer.seed)
    engine = MegatronEngine(engine_options(role, cfg, **kwargs))
    if role == "actor":
        return Actor(engine, cfg.actor, n=cfg.rollout.n)
    if role == "critic":
        return Critic(engine, cfg.critic, n=cfg.rollout.n)
    return Reference(engine) if role == "ref" else RewardModel(engine)
