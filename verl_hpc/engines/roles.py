"""The roles of the RL step on top of any `TrainingEngine` (Megatron's or FSDP's): the trainer
builds the engine its options name and wraps it here (`wrap_role`; verl_hpc/trainer/roles.py:
build_engine(role, cfg, ctx), build_reference(cfg, ctx, actor)):

    Actor:       log_probs(batch), update(batch, loss)
    Reference:   log_probs(batch) (LoRA: the actor's engine, adapters off)
    Teacher:     log_probs(batch) (on-policy distillation: a frozen model of its own folder)
    Critic:      values(batch), update(batch, loss)
    RewardModel: score(batch)
    ProcessRewardModel: log_probs(batch), update(batch, loss)

The loss is the caller's (verl_hpc.algorithms.objectives: PolicyObjective, ValueObjective); a
role only runs it. Batches are the engines' dict format (engines/batch.py) or the trainer's typed
batch (verl_hpc.trainer.stages.step_batch.StepBatch). Keys the objectives read besides the sequence keys,
all `[B, T]`: the policy's: old_log_probs, advantages, and ref_log_probs with the KL loss; the
critic's: values (the critic's at rollout time), returns.

An update runs `ppo_epochs` passes over consecutive mini-batches of `ppo_mini_batch_size` prompts
(x rollout.n sequences), one optimizer step each, then advances the LR schedule by one trainer
step. Metrics are means over the optimizer steps, prefixed with the role ("actor/pg_loss",
"actor/lr" = the LR these steps used);
`<role>/nonfinite_steps` counts skipped steps (the trainer decides what to do about them); with
fp16 loss scaling `<role>/overflow_steps` counts the steps skipped for a loss-scale overflow (not
counted as non-finite) and `<role>/loss_scale` is the scale after the update. The LR schedule
advances only when at least one of the update's steps was applied (TrainingEngine.scheduler_step).
`actor/zero_adv_skipped_share` and `actor/zero_adv_skipped_tokens_share`: the share of the
update's rows (tokens) that the engine left out because their advantages are all 0 (the
objective's rows_without_gradient; 0 when a KL or entropy term forbids it).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.base import LossFn, TrainingEngine
from verl_hpc.engines.batch import ROW_LISTS, Batch, as_engine_batch, get_response_mask, split_rows


def take_rows(batch: Mapping[str, torch.Tensor], rows: List[int]) -> Batch:
    """Rows of every per-row tensor (widths unchanged) and of the per-row lists (ROW_LISTS: a
    vision-language model's images, which the mini-batches of an update must keep)."""
    b = batch["input_ids"].shape[0]
    idx = torch.as_tensor(rows, dtype=torch.long)
    out = {k: v[idx] for k, v in batch.items()
           if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b}
    out.update({k: [batch[k][i] for i in rows] for k in ROW_LISTS if batch.get(k) is not None})
    return out


def rows_to_run(batch, loss_fn: LossFn) -> Tuple[List[int], Optional[Dict[str, float]]]:
    """(the rows whose forward/backward can change the update, {"skipped_rows",
    "skipped_tokens"} or None when the loss offers no skip). Every rank computes the same from
    the same whole batch, so the ranks plan alike.

    Where every row could be skipped, the shortest one still runs (its gradient is exactly 0
    too) and the optimizer step runs as always: the full update's step on a zero gradient
    still moves Adam's moments and the weights, so dropping the step would not be the same
    update; the one row keeps the loss's own metrics in the step (with none, the update's
    mean over its steps would silently leave the step out); and the data-parallel ranks left
    without a row run an empty micro-batch (partition.py), as any rank with no rows does, so
    every rank enters the same collectives."""
    n, mask = batch["input_ids"].shape[0], get_response_mask(batch)
    find = getattr(loss_fn, "rows_without_gradient", None)
    skip = find(dict(batch, response_mask=mask)) if find is not None else None
    if skip is None:
        return list(range(n)), None if find is None else {"skipped_rows": 0.0, "skipped_tokens": 0.0}
    skip = skip.clone()
    if bool(skip.all()) and n:
        skip[int((batch["prompt_lengths"] + batch["response_lengths"]).argmin())] = False
    return ((~skip).nonzero().flatten().tolist(),
            {"skipped_rows": float(skip.sum()), "skipped_tokens": float(mask[skip].sum())})


def _skipped_shares(steps: List[Dict[str, float]], prefix: str, rows: float, tokens: float) -> Dict[str, float]:
    """The share of the update's rows (and of their response tokens) the engine left out for
    adding nothing to the gradient (the engine's skipped_* counts, taken out of `steps`); none when
    the loss offers no skip (the critic's)."""
    if not any("skipped_rows" in m for m in steps):
        return {}
    skipped = [sum(m.pop(k, 0.0) for m in steps) for k in ("skipped_rows", "skipped_tokens")]
    return {f"{prefix}/zero_adv_skipped_share": skipped[0] / max(rows, 1.0),
            f"{prefix}/zero_adv_skipped_tokens_share": skipped[1] / max(tokens, 1.0)}


def _mean_metrics(steps: List[Dict[str, float]], prefix: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for key in sorted({k for m in steps for k in m}):
        vals = [m[key] for m in steps if key in m]
        out[f"{prefix}/{key}"] = sum(vals) / len(vals)
    out[f"{prefix}/nonfinite_steps"] = float(sum(m.get("nonfinite", 0.0) for m in steps))
    out.pop(f"{prefix}/nonfinite", None)
    if any("loss_scale" in m for m in steps):  # fp16: the scale after the update, and its skips
        out[f"{prefix}/loss_scale"] = float(steps[-1]["loss_scale"])
        out[f"{prefix}/overflow_steps"] = float(sum(m.get("overflow", 0.0) for m in steps))
        out.pop(f"{prefix}/overflow", None)
    return out


class _Trainable:
    """A trained role: runs the objective it is handed (verl_hpc.algorithms.objectives) over
    mini-batches; what the loss is belongs to the algorithm library, not to the engine."""

    prefix = ""

    def __init__(self, engine: TrainingEngine, role_cfg, n: int = 1):
        self.engine, self.cfg, self.n = engine, role_cfg, max(1, n)

    def update(self, batch, loss: LossFn) -> Dict[str, float]:
        """`ppo_epochs` passes of one optimizer step per mini-batch of `loss`; `loss.outputs`
        names the engine outputs it needs (default: log-probs)."""
        batch = as_engine_batch(batch)
        size = self.cfg.ppo_mini_batch_size * self.n
        if size < 1:
            raise ConfigError(f"{self.prefix}.ppo_mini_batch_size must be >= 1")
        outputs = tuple(getattr(loss, "outputs", ("log_probs",)))
        steps = []
        with self.engine.resident("train"):  # offloaded states come back once for the whole update
            for _ in range(self.cfg.ppo_epochs):
                for rows in split_rows(batch["input_ids"].shape[0], size):
                    steps.append(self.engine.train_step(take_rows(batch, rows), loss, outputs))
        epochs, mask = self.cfg.ppo_epochs, get_response_mask(batch)
        shares = _skipped_shares(steps, self.prefix, float(mask.shape[0] * epochs), float(mask.sum()) * epochs)
        metrics = _mean_metrics(steps, self.prefix)  # <role>/lr: the LR this update used
        metrics.update(shares)
        self.engine.scheduler_step()
        return metrics


class Actor(_Trainable):
    """The policy: log-probs (and entropy) of the sampled tokens; updates with the objective the
    trainer passes (verl_hpc.algorithms.PolicyObjective)."""

    prefix = "actor"

    def log_probs(self, batch, sum_pi_squared: bool = False) -> Dict[str, torch.Tensor]:
        """pi_old's log-probs and entropy of the sampled tokens; with `sum_pi_squared` also
        sum_v pi_v^2 per token (the optimal token baseline's path energy), from the same forward."""
        extra = ("sum_pi_squared",) if sum_pi_squared else ()
        out = self.engine.forward(as_engine_batch(batch), ("log_probs", "entropy", *extra))
        # routing replay "old": the routes this forward took, for the update to replay
        extra += ("routed_experts",) if "routed_experts" in out else ()
        return {"old_log_probs": out["log_probs"], "entropy": out["entropy"], **{k: out[k] for k in extra}}

    def route_metrics(self) -> Dict[str, float]:
        """Routing replay's router agreement of the forwards since the last call (moe/route_agreement*;
        every rank calls it), {} where the engine has none."""
        get = getattr(self.engine, "route_metrics", None)
        return get() if get is not None else {}


class Critic(_Trainable):
    """Values; updates with the objective the trainer passes (verl_hpc.algorithms.ValueObjective)."""

    prefix = "critic"

    def values(self, batch) -> Dict[str, torch.Tensor]:
        return {"values": self.engine.forward(as_engine_batch(batch), ("values",))["values"]}


class ProcessRewardModel(_Trainable):
    """PRIME's implicit PRM: log-probs of the sampled tokens, whose log-ratio to the reference's is
    the process reward (verl_hpc.algorithms.prime); updates with the objective the trainer passes
    (verl_hpc.algorithms.PrmObjective)."""

    prefix = "prm"

    def log_probs(self, batch) -> Dict[str, torch.Tensor]:
        return {"prm_log_probs": self.engine.forward(as_engine_batch(batch), ("log_probs",))["log_probs"]}


class Reference:
    """Frozen copy of the initial policy: no optimizer, no gradients, forward only. Under LoRA it
    is the actor's own engine with the adapters off (the trainer's build_reference): no second model."""

    def __init__(self, engine: TrainingEngine):
        self.engine = engine

    def log_probs(self, batch) -> Dict[str, torch.Tensor]:
        with self.engine.adapters_off():  # a no-op on an engine of its own
            out = self.engine.forward(as_engine_batch(batch), ("log_probs",))
        return {"ref_log_probs": out["log_probs"]}


class Teacher:
    """On-policy distillation's teacher: a frozen causal LM of its own folder (teacher.model_path),
    forward only, giving the log-prob of each token the student sampled (verl_hpc/algorithms/distill.py)."""

    def __init__(self, engine: TrainingEngine):
        self.engine = engine

    def log_probs(self, batch) -> Dict[str, torch.Tensor]:
        return {"teacher_log_probs": self.engine.forward(as_engine_batch(batch), ("log_probs",))["log_probs"]}


class RewardModel:
    """Frozen value-head model: one score per sequence, from its last token."""

    def __init__(self, engine: TrainingEngine):
        self.engine = engine

    def score(self, batch) -> Dict[str, torch.Tensor]:
        out = self.engine.forward(as_engine_batch(batch), ("scores", "token_scores"))
        return {"rm_scores": out["scores"], "rm_token_scores": out["token_scores"]}


def wrap_role(role: str, engine: TrainingEngine, role_cfg=None, n: int = 1):
    """The role object for `role` in {actor, critic, ref, reward, prm, teacher} over a built engine.
    role_cfg: a trained role's section (actor, critic, prm: its mini-batches and epochs); n: rollout.n."""
    if role == "actor":
        return Actor(engine, role_cfg, n=n)
    if role == "critic":
        return Critic(engine, role_cfg, n=n)
    if role == "prm":
        return ProcessRewardModel(engine, role_cfg, n=n)
    if role == "teacher":
        return Teacher(engine)
    return Reference(engine) if role == "ref" else RewardModel(engine)
