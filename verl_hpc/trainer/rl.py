"""The RL program (`trainer.job: rl`): DESIGN.md's step, for every recipe of the algorithm library.

    python -m verl_hpc.submit configs/grpo_tiny_cpu.yaml --local      # or on Slurm without --local

An algorithm is configuration: the estimator, the policy loss, the KL mode and the aggregation are
read from `algorithm.*` / `actor.*`; the step below is the same for PPO, GRPO, DAPO, RLOO, ReMax,
REINFORCE++ and GSPO. Every rank runs the same code on the same global batch (rank 0 samples the
prompts and broadcasts them); the engines split rows over data-parallel ranks internally.

Checkpoints (verl_hpc/checkpoint/trainer_state.py): resumes per `trainer.resume` before the first
step, saves per `checkpoint.save_every` and at the last step; on the preemption flag (Slurm's
warning signal, or SIGTERM from scancel/preemption) it saves and stops cleanly; runtime/requeue.py then
requeues the job where the rule says so (docs/signals.md), and the requeued job resumes from `latest`.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Dict, Optional

import torch

from verl_hpc.algorithms import make_kl_controller, masked_mean
from verl_hpc.checkpoint.trainer_state import TrainerCheckpointer
from verl_hpc.resharding import WeightSync
from verl_hpc.runtime.watchdog import StageWatchdog, WatchedTimer
from verl_hpc.rollout.metrics import rollout_metrics
from verl_hpc.trainer import shaping
from verl_hpc.trainer.batching import (assemble, broadcast_prompts, concat_batches, first_groups,
                                       logprob_diff_metrics, response_stats)
from verl_hpc.trainer.guard import NonFiniteGuard
from verl_hpc.trainer.roles import build_roles

log = logging.getLogger(__name__)


class RLTrainer:
    def __init__(self, cfg, ctx):
        from verl_hpc.data import PromptLoader, load_val_dataset
        from verl_hpc.rewards import RewardScorer
        from verl_hpc.rollout import SamplingSpec
        from verl_hpc.trainer.validation import Validator

        self.cfg, self.ctx = cfg, ctx
        self.roles = build_roles(cfg, ctx)
        tok, d = self.roles.tokenizer, cfg.data
        self.loader = PromptLoader.from_config(d, tok, d.wrap_plain_text) if ctx.rank == 0 else None
        val_set = load_val_dataset(d, tok, d.wrap_plain_text) if ctx.rank == 0 and cfg.trainer.val_every else None
        self.scorer = RewardScorer.from_config(cfg.reward, self.roles.reward_model, cfg.reward.gsm8k_method)
        if ctx.rank == 0:  # refuse unscorable data before spending compute on it
            ds = self.loader.dataset
            self.scorer.check_samples(*_columns(ds))
            if val_set is not None:
                self.scorer.check_samples(*_columns(val_set))
        self.validator = Validator(cfg, ctx, tok, val_set)
        self.sampling = SamplingSpec.from_config(cfg.rollout)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        self.weight_sync = WeightSync.from_config(cfg.resharding)  # actor -> rollout after every update
        self.checkpointer = TrainerCheckpointer(cfg, ctx, self.roles, loader=self.loader,
                                                kl_ctrl=self.kl_ctrl, guard=self.guard)
        self.inject_nan = set(cfg.trainer.inject_nan_at_steps)

    # ------------------------------------------------------------------------------ the step
    def step(self, step: int, timer) -> Dict[str, float]:
        cfg, r, m = self.cfg, self.roles, {}
        batch, token_scores, baselines = self._sample(step, timer, m)
        m.update(response_stats(batch))
        if len(batch) == 0:  # every group filtered out: nothing to learn from this step
            return dict(m, **{"filter/empty_step": 1.0})
        r.rollout.sleep()  # rollout.sleep_between_phases: free its GPU memory for training; sync wakes it
        t = batch.tensors
        with timer("old_logprob"):
            t.update(r.actor.log_probs(t))
        m.update(logprob_diff_metrics(batch.rollout_log_probs, t["old_log_probs"], t["response_mask"]))
        m["actor/entropy"] = float(masked_mean(t.pop("entropy"), t["response_mask"]))
        if r.ref is not None:
            with timer("ref"):
                t.update(r.ref.log_probs(t))
        if r.critic is not None:
            with timer("values"):
                t.update(r.critic.values(t))
        with timer("adv"):
            rewards, m_kl = shaping.kl_in_reward(token_scores, t, self.kl_ctrl, cfg)
            t["advantages"], t["returns"] = shaping.advantages(cfg, rewards, t, batch.group_ids, baselines)
            if step in self.inject_nan:  # test hook: a NaN loss must be skipped, counted, and stop the run
                t["advantages"] = torch.full_like(t["advantages"], float("nan"))
        m.update(m_kl)
        if r.critic is not None:
            with timer("update_critic"):
                m.update(r.critic.update(t))
        with timer("update_actor"):
            m.update(r.actor.update(t))
        with timer("sync"):
            m.update(self.weight_sync(r.actor, r.rollout))
        m.update(self.guard.check(m, step))
        m["train/tokens"] = float(t["response_mask"].sum() + t["prompt_lengths"].sum())
        m["train/samples"] = float(len(batch))
        return m

    def _sample(self, step: int, timer, m: Dict[str, float]):
        """Prompts -> responses -> token-level scores -> (DAPO) informative groups only.

        With algorithm.filter_groups, rounds of train_batch_size prompts are generated until that
        many groups with differing rewards are kept (the first train_batch_size of them are
        trained on) or algorithm.max_num_gen_batches rounds ran (then the step trains on what it
        kept and says how many groups it missed). Reward and rollout metrics describe the first
        round, unfiltered, as for every other recipe; filter/* the whole step."""
        cfg, r = self.cfg, self.roles
        want = cfg.data.train_batch_size
        rounds = cfg.algorithm.max_num_gen_batches if cfg.algorithm.filter_groups else 1
        parts, kept, dropped = [], 0, {}
        for round_ in range(rounds):
            prompts = broadcast_prompts(self.loader, self.ctx)
            with timer("generate"):
                result = r.rollout.generate(prompts.prompt_ids, self.sampling.for_step(step, round_))
                batch = assemble(prompts, result, r.tokenizer, r.pad_id)
            with timer("reward"):
                scores, m_reward = shaping.score_batch(self.scorer, batch, r.reward_model)
                token_scores, m_shape = shaping.to_token_level(self.scorer, scores, batch, cfg)
                keep, m_filter = shaping.dynamic_sampling_filter(token_scores, batch, cfg)
                baselines = self._greedy_baselines(prompts, batch, step)  # ReMax only
            if round_ == 0:  # tokens/s, lengths, truncated prompts, finish reasons; rewards
                m.update(rollout_metrics(result), **m_reward, **m_shape)
            for k in ("filter/dropped_groups", "filter/dropped_samples"):
                dropped[k] = dropped.get(k, 0.0) + m_filter.get(k, 0.0)
            if not bool(keep.all()):
                batch, token_scores = batch.select(keep), token_scores[keep]
                baselines = baselines[keep] if baselines is not None else None
            parts.append((batch, token_scores, baselines))
            kept += len(set(batch.group_ids.tolist()))
            if kept >= want:
                break
        batch, token_scores = concat_batches([(b, s) for b, s, _ in parts], r.pad_id)
        baselines = None if parts[0][2] is None else torch.cat([bl for _, _, bl in parts])
        if kept > want:  # a full batch, as every other step trains on
            keep = first_groups(batch, want)
            batch, token_scores = batch.select(keep), token_scores[keep]
            baselines = baselines[keep] if baselines is not None else None
        if cfg.algorithm.filter_groups:
            m.update(dropped, **{"filter/gen_batches": float(len(parts)),
                                 "filter/kept_groups": float(min(kept, want)),
                                 "filter/kept_samples": float(len(batch)),
                                 "filter/missing_groups": float(max(want - kept, 0))})
        return batch, token_scores, baselines

    def _greedy_baselines(self, prompts, batch, step) -> Optional[torch.Tensor]:
        """ReMax: the reward of the greedy response to each prompt, per sequence of its group."""
        if self.cfg.algorithm.adv_estimator != "remax":
            return None
        import dataclasses

        spec = dataclasses.replace(self.sampling.for_step(step), n=1, temperature=0.0)
        greedy = assemble(prompts, self.roles.rollout.generate(prompts.prompt_ids, spec),
                          self.roles.tokenizer, self.roles.pad_id)
        scores, _ = shaping.score_batch(self.scorer, greedy, self.roles.reward_model)
        return scores[batch.group_ids]

    # ------------------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        from verl_hpc.config import to_container
        from verl_hpc.tracking import StageTimer, Tracker, throughput

        cfg, ctx, tr = self.cfg, self.ctx, self.cfg.trainer
        os.environ.setdefault("WANDB_MODE", cfg.tracking.wandb_mode)
        start = self.checkpointer.resume()  # 0, or the step of the checkpoint loaded
        if start:
            self.weight_sync(self.roles.actor, self.roles.rollout)
        tracker = Tracker(cfg.tracking.backends, tr.output_dir, tr.total_steps, tr.project_name,
                          tr.experiment_name, to_container(cfg), is_main=ctx.rank == 0,
                          log_every=cfg.tracking.log_every, prometheus_port=cfg.tracking.prometheus_port,
                          plots_enabled=cfg.tracking.plots,
                          # resumed: keep the history up to `start`; fresh: none of an earlier run's
                          start_step=start + 1 if start else 0,
                          console_metrics=cfg.tracking.console_metrics)
        summary = dict(steps=start, stopped="completed", val_before=None, val_after=None, resumed_from=start)
        # a rank stuck in its own code (not in a collective) fails the job naming itself and the stage
        dog = StageWatchdog(tr.stage_timeout_s, ctx.rank).start()
        try:
            if self.validator and not start:
                dog.stage("validate")
                summary["val_before"] = self._validate(tracker, 0)
            timer, t0 = WatchedTimer(StageTimer(), dog), time.time()
            for step in range(start + 1, tr.total_steps + 1):
                metrics = self.step(step, timer)
                metrics.update(timer.pop())
                metrics.update(throughput(metrics["timing_s/step"], tokens=metrics.get("train/tokens"),
                                          samples=metrics.get("train/samples"), world_size=ctx.world_size))
                summary["steps"] = step
                summary["reward_mean"] = metrics.get("reward/score/mean")
                summary.setdefault("history", []).append(
                    {k: v for k, v in metrics.items() if k.startswith(("reward/", "actor/pg_loss"))})
                last = step == tr.total_steps
                if self.validator and (last or step % tr.val_every == 0):
                    dog.stage("validate")
                    metrics.update(val := self._validate(None, step))
                    summary["val_after"] = val
                dog.stage("log")
                tracker.log(metrics, step)
                dog.stage("checkpoint")
                self.checkpointer.maybe_save(step)
                if ctx.preemption.agreed():
                    log.warning("rl: preemption flag set after step %d; saving and stopping", step)
                    self.checkpointer.maybe_save(step, force=True)
                    self.checkpointer.preempted_at = step
                    summary["stopped"] = "preempted"
                    break
            self.checkpointer.close()  # an async save in flight is committed before we report
            summary["seconds"] = round(time.time() - t0, 1)
        finally:
            dog.stop()
            summary["plot"] = str(tracker.close() or "") or None
            summary["metrics_file"] = str(tracker.metrics_path) if tracker.metrics_path else None
        summary["nonfinite_total"] = self.guard.total
        return summary

    def _validate(self, tracker, step: int) -> Dict[str, float]:
        val = self.validator.run(self.roles.rollout, self.scorer, self.roles.pad_id, self.roles.reward_model)
        if tracker is not None:
            tracker.log(val, step)
        if self.ctx.rank == 0:
            log.info("validation at step %d: %s", step,
                     ", ".join(f"{k}={v:.3f}" for k, v in sorted(val.items())))
        return val


def _columns(ds):
    """(ids, data_sources, ground_truths) of a PromptDataset, for RewardScorer.check_samples."""
    b = ds.batch(range(len(ds)))
    return b.ids, b.data_sources, b.ground_truths


def _close_quietly(rollout) -> None:
    try:
        rollout.close()
    except Exception as e:  # noqa: BLE001 - reported, not raised: the error in flight is the one to see
        log.warning("rollout close after an error also failed: %s: %s", type(e).__name__, e)


def run(cfg, ctx) -> dict:
    from verl_hpc.tracking import missing_packages

    missing = missing_packages(cfg.tracking.backends)  # on every rank, before any collective work
    if missing:
        raise RuntimeError(f"tracking.backends needs packages that are not installed: {', '.join(missing)}")
    trainer = RLTrainer(cfg, ctx)
    try:
        summary = trainer.fit()
    except BaseException:  # the engine's shutdown must not bury the error that got us here
        _close_quietly(trainer.roles.rollout)
        raise
    trainer.roles.rollout.close()  # all ranks together, before the runtime tears the process group down
    if ctx.rank == 0:
        out = Path(cfg.trainer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rl_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        print(f"RL_RESULT {json.dumps({k: v for k, v in summary.items() if k != 'history'}, default=str)}",
              flush=True)
    if trainer.checkpointer.preempted_at is not None:  # requeue (SystemExit on every rank) or stop
        from verl_hpc.runtime.requeue import requeue_after_signal

        requeue_after_signal(cfg, ctx, step=trainer.checkpointer.preempted_at,
                             checkpoint_dir=trainer.checkpointer.root)
    return summary
