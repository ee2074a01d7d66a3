"""The losses the trainer hands the engines: what a policy or a critic update minimises.

    loss    = PolicyObjective.from_config(cfg.actor)   # policy loss + KL loss - entropy bonus
    metrics = actor.update(batch, loss)                # the engine only runs it
    metrics = critic.update(batch, ValueObjective.from_config(cfg.critic))
    metrics = prm.update(batch, PrmObjective.from_config(cfg.prm))   # PRIME's implicit PRM

An objective is a `LossFn` (verl_hpc/engines/base.py): called once per micro-batch with the
model's outputs (with grad), the micro-batch and the global counts of the whole batch, it returns
that micro-batch's *contribution* to the full-batch loss, so the sum the engine forms over
micro-batches and data-parallel ranks does not depend on the split. `outputs` names what the
engine must compute for it. `counts` is duck-typed (`tokens`, `seqs`, `norm_len`,
`agg_kwargs()`, i.e. engines.base.GlobalCounts): the algorithm library does not import engines.

An objective may also say which rows of a batch add exactly nothing to its loss and gradient
(`rows_without_gradient`); the engine then leaves them out of the forward and backward while the
counts still include them, so the update is the same (PolicyObjective: rows whose advantages are
all 0, when no term reads them; config/sections/roles.py zero_advantage_skip_blockers).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.roles import zero_advantage_skip_blockers

from .aggregation import agg_loss
from .distill import distill_loss
from .kl import kl_loss
from .masked import zero_advantage_rows
from .policy_losses import compute_policy_loss
from .prime import ce_loss, implicit_scores, implicit_token_rewards, pairwise_loss
from .value_loss import value_loss


def _batch_totals(metrics: Dict[str, torch.Tensor], keys, counts, mask: torch.Tensor) -> None:
    """Turn this micro-batch's contributions in `keys` into whole-batch values: the engine reports
    a token-weighted mean of each metric over the micro-batches it runs, and x run_tokens/mb_tokens
    makes that mean their sum, i.e. the whole batch's value (rows the engine left out add 0)."""
    run = getattr(counts, "run_tokens", None)
    scale = (counts.tokens if run is None else run) / max(float(mask.sum()), 1.0)
    for key in keys:
        if key in metrics:
            metrics[key] = metrics[key] * scale


def _on_policy_metrics(old: torch.Tensor, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor],
                       mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """What the separate old-log-prob forward used to report, from this forward: this micro-batch's
    token means, which the engine averages over micro-batches by tokens (= the batch's token mean).
    rollout_logprob_diff_mean: |rollout engine - actor| log-prob gap, rollout_kl_k1 / _k3: the
    mismatch KL (needs rollout_log_probs in the batch); entropy only where the loss computes it anyway (entropy_coeff > 0)."""
    valid = mask > 0
    n = valid.sum().clamp(min=1)
    m = {}
    if "rollout_log_probs" in mb:
        m["rollout_logprob_diff_mean"] = ((mb["rollout_log_probs"] - old).abs() * valid).sum() / n
        # KL(pi_rollout || pi_old) on the rollout's samples, as the separate pass reports it (mismatch.py)
        log_rho = torch.where(valid, old - mb["rollout_log_probs"], torch.zeros_like(old)).clamp(-20.0, 20.0)
        m["rollout_kl_k1"] = (-log_rho * valid).sum() / n
        m["rollout_kl_k3"] = ((torch.exp(log_rho) - log_rho - 1) * valid).sum() / n
    if "entropy" in out:
        m["entropy"] = (out["entropy"].detach() * valid).sum() / n
    return m


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """PPO-family policy objective: `policy_loss` (actor.policy_loss, clipped per its options)
    + `kl_loss_coef` * KL(actor || ref) when `use_kl_loss` - `entropy_coeff` * entropy, each term
    aggregated with `loss_agg_mode`. Reads old_log_probs, advantages, response_mask, (with the
    KL loss) ref_log_probs, (with mismatch correction) rollout_is_weights, (icepop)
    rollout_log_probs, (m2po) m2po_keep and (teacher.mode = loss: + distill_coef * the reverse KL
    to the teacher, algorithms/distill.py) teacher_log_probs from the micro-batch."""

    # every field is the actor section's of the same name (config/sections/roles.py declares the
    # defaults): required here, so that a default is never written twice
    policy_loss: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    # clip_cov / kl_cov (arXiv 2505.22617): which tokens they clip or penalise
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    ppo_kl_coef: float
    # sapo's gate temperatures, dro's penalty, icepop's band (m2po's threshold is read where its
    # whole-batch mask is made: trainer/stages/correction.py)
    tau_pos: float
    tau_neg: float
    dro_beta: float
    icepop_low: float
    icepop_high: float
    skip_zero_advantage_rows: bool
    # on-policy shortcut (set by the trainer, verl_hpc/trainer/stages/correction.py): pi_old's log-probs
    # are this forward's own, detached -- the ratio is 1 in value and its gradient is grad log pi
    old_from_update: bool = False
    # on-policy distillation in loss mode (teacher.mode = loss, set by the trainer): coef * the
    # reverse KL to the teacher's log-probs (teacher_log_probs in the micro-batch); 0 = no term
    distill_coef: float = 0.0

    @classmethod
    def from_config(cls, actor_cfg, teacher_cfg=None) -> "PolicyObjective":
        """From the `actor` section (ActorConfig) and, for its distillation term, the `teacher`
        section (used when enabled in loss mode)."""
        distill = (teacher_cfg.coef if teacher_cfg is not None and teacher_cfg.enable and teacher_cfg.mode == "loss"
                   else 0.0)
        return cls(**{f.name: getattr(actor_cfg, f.name) for f in dataclasses.fields(cls)
                      if f.name not in ("old_from_update", "distill_coef")}, distill_coef=distill)

    @property
    def outputs(self) -> Tuple[str, ...]:
        return ("log_probs", "entropy") if self.entropy_coeff else ("log_probs",)

    @property
    def batch_extra(self) -> Tuple[str, ...]:
        """Step-batch fields beyond the engines' usual ones that the loss reads per micro-batch
        (StepBatch.engine_batch(extra=...)): icepop the rollout's log-probs."""
        return ("rollout_log_probs",) if self.policy_loss == "icepop" else ()

    def rows_without_gradient(self, batch: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """[B] bool: the rows whose advantages are all 0, which then add exactly 0 to the loss and
        its gradient (every term is -A x a finite value of the row's own tokens); None when a term
        reads them anyway (KL loss, entropy bonus, a loss coupling rows) or the skip is off."""
        if zero_advantage_skip_blockers(self) or self.distill_coef:  # the teacher's term: every row
            return None
        return zero_advantage_rows(batch["advantages"], batch["response_mask"])

    def __call__(self, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor], counts):
        mask = mb["response_mask"]
        agg = dict(loss_agg_mode=self.loss_agg_mode, **counts.agg_kwargs())
        old = out["log_probs"].detach() if self.old_from_update else mb["old_log_probs"]
        loss, metrics = compute_policy_loss(
            self.policy_loss, old, out["log_probs"], mb["advantages"], mask,
            clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c, clip_cov_ratio=self.clip_cov_ratio, clip_cov_lb=self.clip_cov_lb,
            clip_cov_ub=self.clip_cov_ub, kl_cov_ratio=self.kl_cov_ratio, ppo_kl_coef=self.ppo_kl_coef,
            tau_pos=self.tau_pos, tau_neg=self.tau_neg, dro_beta=self.dro_beta, icepop_low=self.icepop_low,
            icepop_high=self.icepop_high, rollout_log_probs=mb.get("rollout_log_probs"),
            m2po_keep=mb.get("m2po_keep"),  # m2po: the step's whole-batch mask (algorithms/m2po.py)
            # mismatch correction (algorithms/mismatch.py): per-token weights, absent when off
            rollout_is_weights=mb.get("rollout_is_weights"), **agg)
        metrics = dict(metrics, pg_loss=loss.detach())
        if self.old_from_update:
            metrics.update(_on_policy_metrics(old, out, mb, mask))
        if self.entropy_coeff:
            ent = agg_loss(out["entropy"], mask, self.loss_agg_mode, counts.tokens, counts.seqs,
                           counts.norm_len)
            loss = loss - self.entropy_coeff * ent
            metrics["entropy_loss"] = ent.detach()
        if self.use_kl_loss and (self.kl_loss_coef or "ref_log_probs" in mb):
            # coefficient 0 and no reference (ref.enable auto): the term is 0, nothing to compute
            if "ref_log_probs" not in mb:
                raise ConfigError("actor.use_kl_loss=true but the batch has no 'ref_log_probs'")
            kl, kl_metrics = kl_loss(out["log_probs"], mb["ref_log_probs"], mask, self.kl_loss_coef,
                                     self.kl_loss_type, **agg)
            loss = loss + kl
            metrics["kl_loss"] = kl_metrics["kl_loss"]
        if self.distill_coef:
            if "teacher_log_probs" not in mb:
                raise ConfigError("teacher.mode = loss but the batch has no 'teacher_log_probs'")
            term, distill_metrics = distill_loss(out["log_probs"], mb["teacher_log_probs"], mask, self.distill_coef,
                                                 **agg)
            loss = loss + term
            metrics.update(distill_metrics)
        _batch_totals(metrics, ("pg_loss", "entropy_loss", "kl_loss", "teacher_kl_loss"), counts, mask)
        return loss, metrics


@dataclasses.dataclass(frozen=True)
class ValueObjective:
    """Value regression with PPO value clipping (critic.cliprange_value), aggregated with
    critic.loss_agg_mode. Reads values (the critic's at rollout time), returns, response_mask."""

    cliprange_value: float  # the critic section's fields (config/sections/roles.py)
    loss_agg_mode: str
    outputs: Tuple[str, ...] = ("values",)

    @classmethod
    def from_config(cls, critic_cfg) -> "ValueObjective":
        """From the `critic` section (CriticConfig)."""
        return cls(cliprange_value=critic_cfg.cliprange_value, loss_agg_mode=critic_cfg.loss_agg_mode)

    def __call__(self, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor], counts):
        loss, metrics = value_loss(out["values"], mb["values"], mb["returns"], mb["response_mask"],
                                   cliprange_value=self.cliprange_value,
                                   loss_agg_mode=self.loss_agg_mode, **counts.agg_kwargs())
        metrics = dict(metrics, vf_loss=loss.detach())
        _batch_totals(metrics, ("vf_loss",), counts, mb["response_mask"])
        return loss, metrics


@dataclasses.dataclass(frozen=True)
class PrmObjective:
    """PRIME's implicit PRM loss (algorithms/prime.py): the response's score is beta x its summed
    log-ratio to the reference; `ce` is the cross-entropy of sigmoid(score) against the 0/1 outcome
    label, `pairwise` the logistic loss of the score against the mean score of the prompt's
    responses with the other label. A mean over the batch's sequences. Reads ref_log_probs,
    outcome_labels [B] and, pairwise, prm_partners [B] (those mean scores, before the update)."""

    beta: float  # the prm section's fields (config/sections/prm.py)
    loss: str
    outputs: Tuple[str, ...] = ("log_probs",)

    @classmethod
    def from_config(cls, prm_cfg) -> "PrmObjective":
        """From the `prm` section (PrmConfig)."""
        return cls(beta=prm_cfg.beta, loss=prm_cfg.loss)

    def __call__(self, out: Mapping[str, torch.Tensor], mb: Mapping[str, torch.Tensor], counts):
        mask = mb["response_mask"]
        rewards = implicit_token_rewards(out["log_probs"], mb["ref_log_probs"], mask, self.beta)
        scores = implicit_scores(rewards, mask)
        labels = mb["outcome_labels"]
        if self.loss == "ce":
            per_seq = ce_loss(scores, labels)
        elif self.loss == "pairwise":
            per_seq = pairwise_loss(scores, labels, mb["prm_partners"])
        else:
            raise ConfigError(f"prm.loss: {self.loss!r}; valid: ce, pairwise")
        loss = per_seq.sum() / counts.seqs  # this micro-batch's share of the batch's mean
        metrics = {f"{self.loss}_loss": loss.detach()}
        _batch_totals(metrics, (f"{self.loss}_loss",), counts, mask)
        return loss, metrics
