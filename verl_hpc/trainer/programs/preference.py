"""Offline preference training (`trainer.job: dpo`): DPO / cDPO, IPO, SimPO, ORPO or KTO
(`algorithm.preference.loss`) on the actor's Megatron engine, with the frozen reference role.

    python -m verl_hpc.submit configs/demo_dpo.yaml --local

A step takes `data.train_batch_size` examples. Paired losses put the chosen responses in rows
0..b-1 and the rejected ones in rows b..2b-1; KTO puts the completions first and, for its reference
point, each prompt with the NEXT example's completion (mismatched pairs) after them.

Why the loss is computed in two passes. A pair's loss couples its chosen and rejected sequence, but
the engine splits rows into micro-batches by length (and over data-parallel ranks) without keeping
pairs together. So the step (1) runs a no-grad forward of the policy on the whole batch (and of the
reference: once per batch, no cache to keep consistent across epochs or resumes), (2) computes the
loss on the `[2b]` sequence log-probs and its derivative c_i = dL / d logp_i by autograd, and (3)
trains on the surrogate sum_i c_i logp_i, whose gradient is exactly dL/dtheta = sum_i c_i
dlogp_i/dtheta whatever the split (the model has no dropout, so both forwards give the same
values). Cost: one extra forward per step.

Metrics: preference/loss and the loss's own metrics (rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/*), and on `data.preference_val_files` (pairs)
val/preference_accuracy = share of held-out pairs whose implicit reward ranks chosen above rejected
(ties count one half: the untrained policy equals the reference, so DPO starts at 0.5).
At the end the weights are written as a Hugging Face folder (trainer.hf_output_dir).

It runs on every program's loop (trainer/programs/base.py). Checkpoints and resume as for RL: the
policy's engine state (weights, Adam moments, LR schedule) and the data position (an EpochSampler's
epoch and offset) per `checkpoint.save_every` and at the last step; `trainer.resume` picks the
checkpoint to start from; Slurm's warning signal or SIGTERM saves at the next step boundary, stops,
and requeues per runtime/requeue.py. The reference is frozen and rebuilt from `model.path`.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, Optional, Tuple

import torch

from verl_hpc.data import DataError
from verl_hpc.engines.batch import length_mask, pack_sequences
from verl_hpc.runtime.objects import broadcast_object
from verl_hpc.trainer.programs.base import (StepProgram, check_tracking, finish, make_checkpointer, save_hf,
                                             steps_from_epochs)
from verl_hpc.trainer.roles import load_tokenizer, pad_token_id
from verl_hpc.trainer.hooks.validation import ValidationHook

log = logging.getLogger(__name__)
REFERENCE_FREE = ("simpo", "orpo")
FORMAT = "verl_hpc.preference_trainer/1"  # trainer_state.format: preference runs resume only from their own


def build_batch(examples, loss: str, pad: int) -> Dict[str, torch.Tensor]:
    """Engine batch for one step (row layout in the module docstring)."""
    prompts = [e.prompt for e in examples]
    if loss == "kto":
        second = [examples[(i + 1) % len(examples)].chosen for i in range(len(examples))]
    else:
        second = [e.rejected for e in examples]
    batch = pack_sequences(prompts + prompts, [e.chosen for e in examples] + second, pad)
    batch["response_mask"] = length_mask(batch["response_lengths"], int(batch["response_lengths"].max())).float()
    return batch


def objective(pr, logps: torch.Tensor, ref_logps: Optional[torch.Tensor], lengths: torch.Tensor,
              desirable: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The configured loss on `[2b]` sequence log-probs laid out as build_batch does."""
    from verl_hpc.algorithms import preference as P

    b = logps.shape[0] // 2
    c, r = logps[:b], logps[b:]
    if pr.loss == "kto":
        return P.kto_loss(c, ref_logps[:b], desirable, r.detach(), ref_logps[b:], pr.beta,
                          pr.desirable_weight, pr.undesirable_weight)
    if pr.loss == "dpo":
        return P.dpo_loss(c, r, ref_logps[:b], ref_logps[b:], pr.beta, pr.label_smoothing)
    if pr.loss == "ipo":
        return P.ipo_loss(c, r, ref_logps[:b], ref_logps[b:], pr.beta)
    if pr.loss == "simpo":
        return P.simpo_loss(c, r, lengths[:b], lengths[b:], pr.beta, pr.gamma, pr.label_smoothing)
    return P.orpo_loss(c, r, lengths[:b], lengths[b:], pr.beta)


def surrogate_loss(out, mb, counts):
    """sum_i c_i logp_i over this micro-batch's rows (c from the first pass; module docstring)."""
    from verl_hpc.algorithms import masked_sum

    lp = out["log_probs"]
    if "pref_coef" not in mb:  # a dummy micro-batch (no rows on this rank)
        return (lp * 0).sum(), {}
    seq = masked_sum(lp, mb["response_mask"], dim=-1)
    return (mb["pref_coef"].to(seq.dtype) * seq).sum(), {}


class PreferenceStep:
    def __init__(self, cfg, policy, ref, pad: int):
        self.cfg, self.policy, self.ref, self.pad = cfg, policy, ref, pad
        self.pr = cfg.algorithm.preference

    def sequence_logps(self, batch) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        from verl_hpc.algorithms.preference import sequence_logps

        mask = batch["response_mask"]
        pol, lengths = sequence_logps(self.policy.engine.forward(batch, ("log_probs",))["log_probs"].double(),
                                      mask)
        ref = None
        if self.ref is not None:
            ref, _ = sequence_logps(self.ref.log_probs(batch)["ref_log_probs"].double(), mask)
        return pol, ref, lengths

    def __call__(self, examples) -> Dict[str, float]:
        batch = build_batch(examples, self.pr.loss, self.pad)
        pol, ref, lengths = self.sequence_logps(batch)
        desirable = torch.tensor([e.desirable for e in examples])
        s = pol.detach().clone().requires_grad_(True)
        loss, metrics = objective(self.pr, s, ref, lengths, desirable)
        (coef,) = torch.autograd.grad(loss, s)
        batch["pref_coef"] = coef.float()
        m = self.policy.engine.train_step(batch, surrogate_loss, ("log_probs",))
        out = {"preference/loss": float(loss), "preference/grad_norm": m["grad_norm"],
               "preference/nonfinite": m["nonfinite"],
               **{f"preference/{k}": m[k] for k in ("loss_scale", "overflow") if k in m}}  # fp16
        out.update({k: float(v) for k, v in metrics.items()})
        return out

    @torch.no_grad()
    def accuracy(self, pairs, batch_size: int) -> float:
        """Held-out preference accuracy (implicit rewards; ties count 1/2)."""
        score = 0.0
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            batch = build_batch(chunk, "dpo", self.pad)
            pol, ref, lengths = self.sequence_logps(batch)
            b = len(chunk)
            if self.pr.loss in REFERENCE_FREE:
                reward = pol / lengths  # the average log-prob (SimPO's and ORPO's reward up to beta)
            else:
                reward = pol - ref
            margin = reward[:b] - reward[b:]
            score += float((margin > 0).sum()) + 0.5 * float((margin == 0).sum())
        return score / max(len(pairs), 1)


class PreferenceProgram(StepProgram):
    """Preference training on every program's loop (trainer/programs/base.py)."""

    name = "dpo"

    def __init__(self, cfg, ctx, train, val, tokenizer):
        from verl_hpc.data.sampler import EpochSampler
        from verl_hpc.trainer.roles import build_engine, build_reference

        super().__init__(cfg, ctx)
        d, pr = cfg.data, cfg.algorithm.preference
        self.train, self.val, self.bs = train, val, d.train_batch_size
        self.total_steps = steps_from_epochs(len(train), self.bs, cfg.trainer.sft_epochs, cfg.trainer.total_steps)
        self.policy = build_engine("actor", cfg, ctx, total_steps=self.total_steps)
        ref = None if pr.loss in REFERENCE_FREE else build_reference(cfg, ctx, self.policy)
        self.step_fn = PreferenceStep(cfg, self.policy, ref, pad_token_id(tokenizer))
        # the data position is (epoch, offset) of a seeded permutation: the same on every rank, and a
        # resumed run draws exactly the examples the uninterrupted one would have
        self.sampler = EpochSampler(len(train), seed=d.seed, fingerprint=f"{pr.loss}:{len(train)}",
                                    data_name="preference set (data.preference_files, algorithm.preference.loss)")
        # the reference is frozen and rebuilt from model.path, as in RL
        self.checkpointer = make_checkpointer(cfg, ctx, engines={"actor": self.policy.engine},
                                              states={"loader": self.sampler}, fmt=FORMAT,
                                              total_steps=self.total_steps)

    def accuracy(self) -> Dict[str, float]:
        return {"val/preference_accuracy": self.step_fn.accuracy(self.val, self.cfg.data.val_batch_size)}

    def step(self, step: int, timer) -> Dict[str, float]:
        with timer("update_actor"):
            metrics = self.step_fn([self.train[i] for i in self.sampler.next_indices(self.bs)])
        metrics["preference/lr"] = self.policy.engine.scheduler_step()
        return metrics

    def begin(self, start: int, summary: Dict, tracker, watchdog) -> None:
        if self.val and not start:
            watchdog.stage("validate")
            before = self.accuracy()
            summary["val_accuracy_before"] = before["val/preference_accuracy"]
            tracker.log(before, 0)

    def extra_hooks(self) -> list:
        return [ValidationHook(lambda step: self.accuracy(), self.cfg.trainer.val_every)] if self.val and \
            self.cfg.trainer.val_every else []

    def end(self, summary: Dict) -> None:
        if summary["stopped"] == "preempted":  # a preempted run exports when its resumed job finishes
            return
        if self.val:
            summary["val_accuracy_after"] = self.accuracy()["val/preference_accuracy"]
        save_hf(self.policy.engine, self.ctx, self.cfg.model.path, self.cfg.trainer.hf_output_dir)


def run(cfg, ctx) -> dict:
    from verl_hpc.data.preference import load_preference_examples

    check_tracking(cfg)
    d, pr = cfg.data, cfg.algorithm.preference
    tokenizer = load_tokenizer(cfg)
    keys = dict(prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                completion_key=d.completion_key, label_key=d.label_key, wrap_plain_text=d.wrap_plain_text,
                max_length=d.max_prompt_length + d.max_response_length)
    load = lambda files, loss, what: load_preference_examples(files, tokenizer, loss, what=what, **keys)  # noqa: E731
    train = broadcast_object(load(d.preference_files, pr.loss, "data.preference_files") if ctx.rank == 0 else None)
    val = broadcast_object(load(d.preference_val_files, "dpo", "data.preference_val_files")
                           if ctx.rank == 0 and d.preference_val_files else None) or []
    bs = d.train_batch_size
    if len(train) < max(bs, 2):
        raise DataError(f"trainer.job=dpo: {len(train)} usable rows in data.preference_files, fewer than "
                        f"data.train_batch_size={bs} (or 2 for KTO's mismatched pairs)")
    program = PreferenceProgram(cfg, ctx, train, val, tokenizer)
    summary = program.fit(dict(loss=pr.loss, rows=len(train), val_rows=len(val)))
    hist = summary.get("history", [])
    summary.update(total_steps=program.total_steps, hf_dir=cfg.trainer.hf_output_dir,
                   first_loss=hist[0]["preference/loss"] if hist else math.nan,
                   last_loss=hist[-1]["preference/loss"] if hist else math.nan)
    return finish(cfg, ctx, "dpo", summary, requeue=program.requeue)
