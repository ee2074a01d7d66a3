"""The RL program (`trainer.job: rl`): the RL step (docs/architecture.md) for every recipe.

    python -m verl_hpc.submit configs/grpo_tiny_cpu.yaml --local      # or on Slurm without --local

An algorithm is configuration: the estimator, the policy loss, the KL mode and the aggregation are
read from `algorithm.*` / `actor.*`; the step below is the same for PPO, GRPO, DAPO, RLOO, ReMax,
REINFORCE++ and GSPO. Every rank runs the same code on the same global batch (rank 0 samples the
prompts and broadcasts them); the engines split rows over data-parallel ranks internally.

One step: (1) the rollout phase: if the rollout's weights are stale, wake its weights, sync
the actor's into them (the actor resident until the rollout has loaded the last bucket), then wake
its KV cache; generate, score, filter; (2) the rollout to sleep; (3) old log-probs, reference
log-probs, (PRIME) the implicit PRM's rewards and update, values, advantages, critic update, actor
update: the rollout's weights are now stale. In PRIME's warm-up steps (prm.warmup_steps) only the
PRM trains.
The sync is lazy (trainer/rollout_weights.py): it runs right before the weights are next needed (the
next step's generation or a validation), never at the end of a step, so a checkpoint saved after
the step finds the rollout asleep.

The step's pieces: trainer/rollout_weights.py (lazy sync, staged wake), trainer/sampling.py
(generate, score, group filters), trainer/step_batch.py (the typed batch the stages fill),
trainer/prm_stage.py (PRIME's implicit PRM), trainer/advantage.py (KL in reward, advantages), verl_hpc.algorithms.objectives (the losses the
actor and critic updates minimise). After each step the hooks run in this order (trainer/hooks.py;
RLTrainer.hooks): validation, task weights, rollback, log, checkpoint, stop rule, preemption.
trainer/program.py owns the tracker's lifecycle, rl_summary.json, the RL_RESULT line and the requeue.

Checkpoints (verl_hpc/checkpoint/trainer_state.py): resumes per `trainer.resume` before the first
step, saves per `checkpoint.save_every` and at the last step (with the rollout asleep: a save or
load puts it to sleep first, and a load marks its weights stale); on the preemption flag (Slurm's
warning signal, or SIGTERM from scancel/preemption) it saves and stops cleanly; runtime/requeue.py then
requeues the job where the rule says so (docs/signals.md), and the requeued job resumes from `latest`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from typing import Dict

from verl_hpc.algorithms import PolicyObjective, ValueObjective, make_kl_controller
from verl_hpc.checkpoint.trainer_state import TrainerCheckpointer
from verl_hpc.data import PromptLoader, load_val_dataset
from verl_hpc.trainer.rollout_weights import weight_sync_from_config
from verl_hpc.rewards import RewardScorer
from verl_hpc.rollout import SamplingSpec
from verl_hpc.runtime import collectives
from verl_hpc.runtime.signals import WARNING_SIGNAL
from verl_hpc.runtime.split import STOP
from verl_hpc.runtime.watchdog import StageWatchdog, WatchedTimer
from verl_hpc.tracking import StageTimer, throughput
from verl_hpc.trainer import correction
from verl_hpc.trainer.advantage import AdvantageStage
from verl_hpc.trainer.batching import response_stats
from verl_hpc.trainer.guard import NonFiniteGuard
from verl_hpc.trainer.loops.async_link import AsyncLink
from verl_hpc.trainer.loops.remote import PublishedWeights, RemoteRollout
from verl_hpc.trainer.hooks import CheckpointHook, LogHook, PreemptionHook, RunState, run_steps
from verl_hpc.trainer.program import check_tracking, finish, tracked
from verl_hpc.trainer.prm_stage import PrmStage
from verl_hpc.trainer.roles import build_roles
from verl_hpc.trainer.rollback import RollbackGuard, RollbackHook, apply_lr_factor
from verl_hpc.trainer.rollout_weights import RolloutWeights
from verl_hpc.trainer.safety import SafetySwitches
from verl_hpc.trainer.sampling import StepSampler
from verl_hpc.trainer.stopping import StopHook, StopRule
from verl_hpc.trainer.task_weights import TaskWeightHook, TaskWeightScheduler
from verl_hpc.trainer.validation import ValidationHook, Validator

log = logging.getLogger(__name__)


class RLTrainer:
    def __init__(self, cfg, ctx, roles=None):
        """roles: the Roles to run (default: built from cfg, a collective); tests pass fakes."""
        self.cfg, self.ctx = cfg, ctx
        self.roles = roles if roles is not None else build_roles(cfg, ctx)
        tok, d = self.roles.tokenizer, cfg.data
        self.steps_done = 0  # the policy version: training steps completed
        # placement.mode=split: batches come from the rollout group, weights go to it (trainer/loops/)
        self.link = AsyncLink(cfg, ctx) if cfg.placement.split and ctx.role == "train" else None
        if self.link is not None:
            self.roles.rollout = RemoteRollout(self.link, lambda: self.steps_done)
        tools = self.roles.episodes.tool_schemas() if self.roles.episodes is not None and ctx.rank == 0 else None
        self.loader = (PromptLoader.from_config(d, tok, d.wrap_plain_text, tools=tools)
                       if ctx.rank == 0 and self.link is None else None)  # split: on the rollout leader
        val_set = load_val_dataset(d, tok, d.wrap_plain_text, tools=tools) if ctx.rank == 0 and cfg.trainer.val_every else None
        self.scorer = RewardScorer.from_config(cfg.reward, self.roles.reward_model,
                                               allow_custom_code=cfg.safety.allow_custom_code)
        if ctx.rank == 0 and self.loader is not None:  # refuse unscorable data before spending compute on it
            ds = self.loader.dataset
            self.scorer.check_samples(*_columns(ds))
            if val_set is not None:
                self.scorer.check_samples(*_columns(val_set))
        self.validator = Validator(cfg, ctx, tok, val_set)
        self.sampler = StepSampler(cfg, ctx, self.roles, self.loader, self.scorer, SamplingSpec.from_config(cfg.rollout),
                                   source=self.link.next_batch if self.link is not None else None)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.advantage = AdvantageStage(cfg.algorithm, self.kl_ctrl, cfg.prm)
        self.prm_stage = PrmStage(cfg, self.roles.prm) if self.roles.prm is not None else None
        self.policy_loss = PolicyObjective.from_config(cfg.actor)
        self.on_policy_loss = dataclasses.replace(self.policy_loss, old_from_update=True)
        self._logged_path = None
        self.value_loss = ValueObjective.from_config(cfg.critic)
        self.guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        # actor -> rollout, lazily: before the next generation after every update (split: published
        # to the rollout group, which takes the newest between its generation chunks)
        self.rollout_weights = (PublishedWeights(self.link, self.roles.actor, lambda: self.steps_done)
                                if self.link is not None else
                                RolloutWeights(self.roles.actor, self.roles.rollout,
                                               weight_sync_from_config(cfg, getattr(self.roles.rollout, "name",
                                                                                cfg.rollout.engine))))
        if self.link is None:
            self.roles.verify = self.rollout_weights.check_generated
        self.task_weights = TaskWeightScheduler.from_config(d)  # None without data.tasks
        self.rollback = RollbackGuard(cfg, ctx)  # falsy unless trainer.rollback.enable
        self.checkpointer = TrainerCheckpointer(cfg, ctx, self.roles, loader=self.link or self.loader,
                                                kl_ctrl=self.kl_ctrl,
                                                guard=self.guard, task_weights=self.task_weights,
                                                rollback=self.rollback, before_state=self.rollout_weights.park,
                                                after_load=self.rollout_weights.mark_stale)
        self.safety = SafetySwitches(cfg, ctx)

    # ------------------------------------------------------------------------------ the step
    def step(self, step: int, timer) -> Dict[str, float]:
        r = self.roles
        self.rollout_weights.ready(timer)  # if stale: wake weights, sync, then wake the KV cache
        m = self.rollout_weights.pop_metrics()  # sync/* of the sync that gave it these weights
        batch, sampled = self.sampler.sample(step, timer)  # prompts -> responses -> scores (-> group filters)
        m.update(sampled, **response_stats(batch))
        if len(batch) == 0:  # every group filtered out: nothing to learn from this step
            self.steps_done = step
            return dict(m, **{"filter/empty_step": 1.0})
        self.rollout_weights.park()  # rollout.sleep_between_phases: free its GPU memory for training
        warmup = self.prm_stage is not None and step <= self.cfg.prm.warmup_steps  # only the PRM trains
        path = self._old_log_prob_path(batch)
        if path != "update" and not warmup:  # update: the actor update's own forward gives them (on-policy shortcut)
            correction.old_log_probs(self.cfg, r.actor, batch, timer, m)  # forward, or bypass: the rollout's
            m.update(correction.apply(self.cfg, batch))  # rollout/training mismatch: metrics, IS weights
        if r.ref is not None:
            with timer("ref"):
                batch.fill(r.ref.log_probs(batch))  # ref_log_probs
        if self.prm_stage is not None:
            m.update(self.prm_stage(batch, timer))  # process_rewards; the PRM's update (prm.update)
        if warmup:
            self.steps_done = step
            if self.link is not None:  # split: publish the version (same weights), else the rollout group waits on it
                self.rollout_weights.mark_stale()
            return dict(m, **self._batch_size(batch), **{"prm/warmup": 1.0}, **self.guard.check(m, step))
        if r.critic is not None:
            with timer("values"):
                batch.fill(r.critic.values(batch))  # values
        with timer("adv"):
            m.update(self.advantage(batch))  # rewards (- KL penalty), advantages, returns
        if r.critic is not None:
            with timer("update_critic"):
                m.update(r.critic.update(batch, self.value_loss))
        with timer("update_actor"):
            if path == "update":
                m.update(r.actor.update(batch.engine_batch(extra=("rollout_log_probs",)), self.on_policy_loss))
                correction.on_policy_metrics(m)
            else:
                m.update(r.actor.update(batch, self.policy_loss))
        self.steps_done = step  # the policy version: before mark_stale, which publishes it in split placement
        self.rollout_weights.mark_stale()  # colocated: synced before the weights are next needed, not now
        m.update(self.guard.check(m, step), **self._batch_size(batch))
        return m

    @staticmethod
    def _batch_size(batch) -> Dict[str, float]:
        return {"train/tokens": float(batch.mask.sum() + batch.prompt_lengths.sum()), "train/samples": float(len(batch))}

    def _old_log_prob_path(self, batch) -> str:
        """correction.old_log_prob_path, logged (rank 0) the first time and whenever it changes."""
        path, why = correction.old_log_prob_path(self.cfg, batch, self.roles.ref is not None)
        if path != self._logged_path and self.ctx.rank == 0:
            say = {"update": "taken from the actor update's own forward (no separate pass)",
                   "forward": "a separate actor forward", "bypass": "the rollout engine's"}[path]
            log.info("old log-probs: %s (%s)", say, why)
        self._logged_path = path
        return path

    # ------------------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg, ctx, tr = self.cfg, self.ctx, self.cfg.trainer
        os.environ.setdefault("WANDB_MODE", cfg.tracking.wandb_mode)
        start = self._resume()
        self.steps_done = start
        if self.link is not None:
            self.link.start(start)  # the rollout group begins (or continues what the checkpoint held)
        summary = dict(steps=start, stopped="completed", val_before=None, val_after=None, resumed_from=start)
        # resumed: keep the history up to `start`; fresh: none of an earlier run's
        with tracked(cfg, ctx, summary, start_step=start + 1 if start else 0) as tracker:
            # a rank stuck in its own code (not in a collective) fails the job naming itself and the stage
            dog = StageWatchdog(tr.stage_timeout_s, ctx.rank).start()
            stop_rule = StopRule.from_config(tr.stop_at, ctx)  # the wall-time budget counts from here
            try:
                if self.validator and not start:
                    dog.stage("validate")
                    summary["val_before"] = self._validate(tracker, 0)
                # comm_bytes: payload of every collective per stage (benchmarks/bench_scaling.py)
                timer = WatchedTimer(StageTimer(comm=collectives.counts if cfg.tracking.comm_bytes else None), dog)
                run = RunState(tracker, timer, dog, summary, tr.total_steps, start=start)
                t0 = time.time()
                run_steps(lambda step: self._measured_step(step, timer), self.hooks(stop_rule), run)
                self.checkpointer.close()  # an async save in flight is committed before we report
                summary["seconds"] = round(time.time() - t0, 1)
            finally:
                dog.stop()
        summary["plot"] = str(tracker.plot_path or "") or None
        summary["metrics_file"] = str(tracker.metrics_path) if tracker.metrics_path else None
        summary["nonfinite_total"] = self.guard.total
        if self.link is not None:  # split: what this process trained on, in order (resume checks)
            summary["trained_prompt_ids"] = list(self.link.trained_ids)
        return summary

    def hooks(self, stop_rule: StopRule) -> list:
        """What runs after each step, in this order (trainer/hooks.py)."""
        ckpt = self.checkpointer
        return [h for h in (
            ValidationHook(lambda step: self._validate(None, step), self.cfg.trainer.val_every)
            if self.validator else None,
            TaskWeightHook(self.task_weights, self.loader) if self.task_weights is not None else None,
            RollbackHook(self.rollback, ckpt, self.cfg, self.ctx, self.roles, loader=self.loader,
                         task_weights=self.task_weights) if self.rollback else None,
            LogHook(), CheckpointHook(ckpt), StopHook(stop_rule, ckpt, self.ctx.rank, self.cfg.trainer.job),
            PreemptionHook(ckpt),
        ) if h is not None]

    def _resume(self) -> int:
        """Load the checkpoint trainer.resume picks (0: none), with the LR earlier rollbacks left.
        The rollout's weights are stale either way: the first generation (or validation) syncs."""
        start = self.checkpointer.resume()
        if self.rollback.lr_factor != 1.0:  # LR lowered by earlier rollbacks of this run
            apply_lr_factor(self.roles, self.cfg, self.rollback.lr_factor)
        return start

    def _measured_step(self, step: int, timer) -> Dict[str, float]:
        """The step, checked across ranks, with its stage timings and throughput."""
        with self.safety.step(step):  # safety.profiling traces listed steps; nothing when off
            metrics = self.step(step, timer)
        self.safety.check_ranks_agree(step, metrics)
        if step == self.cfg.trainer.inject_warning_signal_at_step:  # tests: a preemption at a chosen moment
            signal.raise_signal(WARNING_SIGNAL)
        metrics.update(timer.pop())
        metrics.update(throughput(metrics["timing_s/step"], tokens=metrics.get("train/tokens"),
                                  samples=metrics.get("train/samples"), world_size=self.ctx.world_size))
        if "timing_s/wait_rollout" in metrics:  # split: the training group's wait on the rollout group
            busy = max(metrics["timing_s/step"] - metrics["timing_s/wait_rollout"], 1e-9)
            metrics["async/idle_frac/train"] = metrics["timing_s/wait_rollout"] / max(metrics["timing_s/step"], 1e-9)
            metrics["async/tokens_per_s/train"] = metrics.get("train/tokens", 0.0) / busy
        return metrics

    def _validate(self, tracker, step: int) -> Dict[str, float]:
        self.rollout_weights.ready()  # its sync/* go to the next step's row (rollout_weights.py)
        val = self.validator.run(self.roles.generate, self.scorer, self.roles.pad_id, self.roles.reward_model)
        if tracker is not None:
            tracker.log(val, step)
        if self.ctx.rank == 0:
            log.info("validation at step %d: %s", step,
                     ", ".join(f"{k}={v:.3f}" for k, v in sorted(val.items())))
        return val


def _release_rollout(ctx) -> None:
    """A split job's trainer that fails before its link exists still lets the rollout group go."""
    if ctx.split.is_leader:
        try:
            ctx.split.mailbox.put(STOP, True)
        except Exception:  # noqa: BLE001 - the error in flight is the one to report
            pass


def _columns(ds):
    """(ids, data_sources, ground_truths) of a PromptDataset, for RewardScorer.check_samples."""
    b = ds.batch(range(len(ds)))
    return b.ids, b.data_sources, b.ground_truths


def run(cfg, ctx) -> dict:
    check_tracking(cfg)
    if cfg.placement.split and ctx.role == "rollout":  # this rank only generates
        from verl_hpc.trainer.loops import rollout_worker

        return rollout_worker.run(cfg, ctx)
    roles = build_roles(cfg, ctx, with_rollout=not cfg.placement.split)
    # The rollout engine is closed on every way out (after a clean run all ranks together), an
    # error in the trainer's construction or in fit included, before job.run's runtime.shutdown()
    # drops the process group: vLLM's exit-time finalizer would otherwise print a traceback after
    # the `error:` line. Split: the rollout group is released (told to stop) the same way.
    trainer = None
    try:
        with roles.rollout or contextlib.nullcontext(), roles.episodes or contextlib.nullcontext():
            trainer = RLTrainer(cfg, ctx, roles)
            with trainer.roles.rollout if trainer.link else contextlib.nullcontext():
                summary = trainer.fit()
    finally:
        if trainer is None and cfg.placement.split:  # failed before the link existed
            _release_rollout(ctx)
    return finish(cfg, ctx, "rl", summary, requeue=trainer.checkpointer.requeue_if_preempted)
