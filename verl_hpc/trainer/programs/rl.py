"""The RL program (`trainer.job: rl`): the RL step (docs/architecture.md) for every recipe.

    python -m verl_hpc.submit configs/grpo_tiny_cpu.yaml --local      # or on Slurm without --local

An algorithm is configuration: the estimator, the policy loss, the KL mode and the aggregation are
read from `algorithm.*` / `actor.*`; the step below is the same for PPO, GRPO, DAPO, RLOO, ReMax,
REINFORCE++ and GSPO. Every rank runs the same code on the same global batch (rank 0 samples the
prompts and broadcasts them); the engines split rows over data-parallel ranks internally.

One step: (1) the rollout phase: if the rollout's weights are stale, wake its weights, sync
the actor's into them (the actor resident until the rollout has loaded the last bucket), then wake
its KV cache; generate, score, filter; (2) the rollout to sleep; (3) old log-probs, reference
log-probs, (on-policy distillation) the teacher's log-probs, (PRIME) the implicit PRM's rewards and update, values, advantages, critic update, actor
update: the rollout's weights are now stale. In PRIME's warm-up steps (prm.warmup_steps) only the
PRM trains.
The sync is lazy (trainer/stages/rollout_weights.py): it runs right before the weights are next needed (the
next step's generation or a validation), never at the end of a step, so a checkpoint saved after
the step finds the rollout asleep.

The step's pieces: trainer/stages/rollout_weights.py (lazy sync, staged wake), trainer/stages/sampling.py
(generate, score, group filters), trainer/stages/step_batch.py (the typed batch the stages fill),
trainer/stages/prm_stage.py (PRIME's implicit PRM), trainer/stages/teacher_stage.py (on-policy distillation), trainer/stages/advantage.py (KL in reward, advantages), verl_hpc.algorithms.objectives (the losses the
actor and critic updates minimise). The loop is every program's (trainer/programs/base.py: StepProgram.fit): after each step the hooks run
in this order (trainer/hooks/base.py): validation, task weights, rollback (RLTrainer.extra_hooks), then
log, checkpoint, stop rule, preemption. Where generation runs (placement.mode) is an object chosen
once (trainer/placement.py): where batches come from, where weights go, what a checkpoint holds.

Checkpoints (verl_hpc/checkpoint/checkpointer.py, with the objects RLTrainer registers): resumes per `trainer.resume` before the first
step, saves per `checkpoint.save_every` and at the last step (with the rollout asleep: a save or
load puts it to sleep first, and a load marks its weights stale); on the preemption flag (Slurm's
warning signal, or SIGTERM from scancel/preemption) it saves and stops cleanly; runtime/requeue.py then
requeues the job where the rule says so (docs/signals.md), and the requeued job resumes from `latest`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Dict

from verl_hpc.algorithms import PolicyObjective, ValueObjective, make_kl_controller
from verl_hpc.data import PromptLoader, load_val_dataset
from verl_hpc.data.processor import ImagePrompts
from verl_hpc.trainer.stages.rollout_weights import weight_sync_from_config
from verl_hpc.rewards import RewardScorer
from verl_hpc.rollout import SamplingSpec
from verl_hpc.rollout.recovery import RestartsExhausted
from verl_hpc.runtime import faults
from verl_hpc.trainer.stages import correction
from verl_hpc.trainer.stages.advantage import AdvantageStage
from verl_hpc.trainer.stages.batching import response_stats
from verl_hpc.trainer.hooks.guard import NonFiniteGuard
from verl_hpc.trainer.hooks.mismatch_trend import MismatchTrendHook
from verl_hpc.trainer.placement import choose
from verl_hpc.trainer.programs.base import StepProgram, check_tracking, finish, make_checkpointer
from verl_hpc.trainer.stages.prm_stage import PrmStage
from verl_hpc.trainer.stages.rm_record import RewardModelRecord
from verl_hpc.trainer.stages.teacher_stage import TeacherRecord, TeacherStage
from verl_hpc.trainer.roles import build_roles
from verl_hpc.trainer.hooks.rollback import RollbackGuard, RollbackHook, apply_lr_factor
from verl_hpc.trainer.hooks.safety import SafetySwitches
from verl_hpc.trainer.stages.sampling import StepSampler
from verl_hpc.trainer.hooks.task_weights import TaskWeightHook, TaskWeightScheduler
from verl_hpc.trainer.hooks.validation import ValidationHook, Validator

log = logging.getLogger(__name__)
FORMAT = "verl_hpc.rl_trainer/1"  # trainer_state.format of RL checkpoints: RL resumes only from its own


class RLTrainer(StepProgram):
    name = "rl"
    history_prefixes = ("reward/", "actor/pg_loss")
    headline = ("reward_mean", "reward/score/mean")

    def __init__(self, cfg, ctx, roles=None, placement=None):
        """roles: the Roles to run (default: built from cfg, a collective); placement: where
        generation runs (default: per placement.mode); tests pass fakes."""
        super().__init__(cfg, ctx)
        self.placement = placement or choose(cfg, ctx)
        self.roles = roles if roles is not None else build_roles(cfg, ctx)
        tok, d = self.roles.tokenizer, cfg.data
        self.total_steps = cfg.trainer.total_steps
        self.steps_done = 0  # the policy version: training steps completed
        self.placement.attach(self.roles, lambda: self.steps_done)
        tools = self.roles.episodes.tool_schemas() if self.roles.episodes is not None and ctx.rank == 0 else None
        images = ImagePrompts.from_config(cfg.model, cfg.vision) if ctx.rank == 0 else None  # the processor of a VLM
        self.loader = self.placement.loader(lambda: PromptLoader.from_config(d, tok, d.wrap_plain_text, tools=tools,
                                                                            images=images))
        val_set = (load_val_dataset(d, tok, d.wrap_plain_text, tools=tools, images=images)
                   if ctx.rank == 0 and cfg.trainer.val_every else None)
        self.scorer = RewardScorer.from_config(cfg.reward, self.roles.reward_model,
                                               allow_custom_code=cfg.safety.allow_custom_code)
        if self.loader is not None:  # refuse unscorable data before spending compute on it
            if not cfg.agent.enable:  # agent runs return their own rewards: no reward function is run
                self.scorer.check_samples(*_columns(self.loader.dataset))
            if self.roles.teacher is not None:  # and rows no teacher scores
                self.roles.teacher.check_sources(_columns(self.loader.dataset)[1])
            if val_set is not None and not cfg.agent.enable:  # reward.reward_model.validate = false: the rules must score it alone
                (self.scorer if cfg.reward.reward_model.validate else self.scorer.rules_only()).check_samples(
                    *_columns(val_set))
        self.validator = Validator(cfg, ctx, tok, val_set)
        self.sampler = StepSampler(cfg, ctx, self.roles, self.loader, self.scorer, SamplingSpec.from_config(cfg.rollout),
                                   source=self.placement.source)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.advantage = AdvantageStage(cfg.algorithm, self.kl_ctrl, cfg.prm, cfg.teacher)
        self.prm_stage = PrmStage(cfg, self.roles.prm) if self.roles.prm is not None else None
        self.teacher_stage = TeacherStage(self.roles.teacher) if self.roles.teacher is not None else None
        self.policy_loss = PolicyObjective.from_config(cfg.actor, cfg.teacher)  # teacher.mode = loss: its term
        self.on_policy_loss = dataclasses.replace(self.policy_loss, old_from_update=True)
        self._logged_path = None
        self.value_loss = ValueObjective.from_config(cfg.critic)
        self.guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        # actor -> rollout, lazily: before the next generation after every update
        self.rollout_weights = self.placement.weights(self.roles.actor, self.roles, lambda: weight_sync_from_config(
            cfg, getattr(self.roles.rollout, "name", cfg.rollout.engine)))
        self.task_weights = TaskWeightScheduler.from_config(d)  # None without data.tasks
        self.rollback = RollbackGuard(cfg, ctx)  # falsy unless trainer.rollback.enable
        states = {"loader": self.placement.checkpoint_state(self.loader), "kl_ctrl": self.kl_ctrl,
                  "guard": self.guard, "task_weights": self.task_weights, "rollback": self.rollback,
                  # frozen: named by folder and fingerprint, never saved (trainer/stages/teacher_stage.py)
                  "teacher": TeacherRecord(cfg.teacher) if self.roles.teacher is not None else None,
                  # the scorer or judge: frozen as well (verl_hpc/trainer/stages/rm_record.py)
                  "reward_model": (RewardModelRecord(cfg.reward.reward_model, self.roles.reward_model)
                                   if self.roles.reward_model is not None else None)}
        self.checkpointer = make_checkpointer(
            cfg, ctx, engines=self.roles.trained_engines(), states={k: v for k, v in states.items() if v is not None},
            fmt=FORMAT, total_steps=self.total_steps,
            before_state=self.rollout_weights.park, after_load=self.rollout_weights.mark_stale)
        self.safety = SafetySwitches(cfg, ctx)
        risk = correction.uncorrected_risk(cfg)  # a quantized rollout with the correction off: said once
        if risk and ctx.rank == 0:
            log.warning(risk)

    # ------------------------------------------------------------------------------ the step
    def step(self, step: int, timer) -> Dict[str, float]:
        r = self.roles
        faults.at_step(step)  # the resilience tests' hook (VERL_HPC_FAULT); nothing when unset
        faults.maybe("step")
        self.rollout_weights.new_step(step)  # the engine recovery's per-step bounds (rollout/recovery.py)
        self.rollout_weights.ready(timer)  # if stale: wake weights, sync, then wake the KV cache
        m = self.rollout_weights.pop_metrics()  # sync/* of the sync that gave it these weights
        batch, sampled = self.sampler.sample(step, timer)  # prompts -> responses -> scores (-> group filters)
        m.update(sampled, **response_stats(batch), **self.rollout_weights.pop_recovery())
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
        if self.teacher_stage is not None and not warmup:  # on-policy distillation: the teacher scores the samples
            m.update(self.teacher_stage(batch, timer))  # teacher_log_probs; teacher/kl
        if self.prm_stage is not None:
            m.update(self.prm_stage(batch, timer))  # process_rewards; the PRM's update (prm.update)
        if warmup:
            self.steps_done = step
            self.rollout_weights.unchanged()  # a new policy version with the same weights
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
            faults.maybe("update")
            if path == "update":
                m.update(r.actor.update(batch.engine_batch(extra=("rollout_log_probs",)), self.on_policy_loss))
                correction.on_policy_metrics(m)
            else:
                extra = self.policy_loss.batch_extra  # icepop: the rollout's log-probs too
                m.update(r.actor.update(batch.engine_batch(extra=extra) if extra else batch, self.policy_loss))
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

    # ------------------------------------------------------------------------------ around the step
    def fit(self) -> dict:
        summary = super().fit(dict(val_before=None, val_after=None))
        summary["nonfinite_total"] = self.guard.total
        summary.update(self.placement.summary())
        return summary

    def resume(self) -> int:
        """Load the checkpoint trainer.resume picks (0: none), with the LR earlier rollbacks left.
        The rollout's weights are stale either way: the first generation (or validation) syncs."""
        start = self.checkpointer.resume()
        if self.rollback.lr_factor != 1.0:  # LR lowered by earlier rollbacks of this run
            apply_lr_factor(self.roles, self.cfg, self.rollback.lr_factor)
        return start

    def begin(self, start: int, summary: Dict, tracker, watchdog) -> None:
        self.steps_done = start
        self.placement.start(start)
        if self.validator and not start:
            watchdog.stage("validate")
            summary["val_before"] = self._validate(tracker, 0)

    def extra_hooks(self) -> list:
        """Validation, task weights, rollback: before log, checkpoint, stop rule, preemption."""
        return [h for h in (
            ValidationHook(lambda step: self._validate(None, step), self.cfg.trainer.val_every)
            if self.validator else None,
            TaskWeightHook(self.task_weights, self.loader) if self.task_weights is not None else None,
            RollbackHook(self.rollback, self.checkpointer, self.cfg, self.ctx, self.roles, loader=self.loader,
                         task_weights=self.task_weights) if self.rollback else None,
            MismatchTrendHook(),  # rollout_corr/kl_trend, before the log hook writes the step's metrics
        ) if h is not None]

    def checked_step(self, step: int, timer) -> Dict[str, float]:
        """The step, checked across ranks (safety.debug) and profiled where asked. A rollout engine
        that failed past rollout.max_engine_restarts: the steps done are saved, then the job stops."""
        with self.safety.step(step):  # safety.profiling traces listed steps; nothing when off
            try:
                metrics = self.step(step, timer)
            except RestartsExhausted:
                if self.steps_done >= 1:  # every rank raised it together: the save is collective
                    try:
                        self.checkpointer.maybe_save(self.steps_done, force=True)
                    except Exception as e:  # noqa: BLE001 - the engine's error is the one to report
                        log.error("saving step %d after the rollout engine failed: %s: %s", self.steps_done,
                                  type(e).__name__, e)
                raise
        self.safety.check_ranks_agree(step, metrics)
        return metrics

    def timed_metrics(self, metrics: Dict[str, float]) -> None:
        self.placement.timed_metrics(metrics)

    def _validate(self, tracker, step: int) -> Dict[str, float]:
        self.rollout_weights.ready()  # its sync/* go to the next step's row (rollout_weights.py)
        rm = self.roles.reward_model if self.cfg.reward.reward_model.validate else None
        scorer = self.scorer if rm is not None or self.roles.reward_model is None else self.scorer.rules_only()
        val = self.validator.run(self.roles.generate, scorer, self.roles.pad_id, rm)
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


def run(cfg, ctx) -> dict:
    check_tracking(cfg)
    placement = choose(cfg, ctx)  # a split job's rollout ranks serve the training group instead
    return placement.run_rank(lambda: _train(cfg, ctx, placement))


def _train(cfg, ctx, placement) -> dict:
    roles = build_roles(cfg, ctx, with_rollout=placement.builds_rollout)
    # The rollout engine is closed on every way out (after a clean run all ranks together), an
    # error in the trainer's construction or in fit included, before job.run's runtime.shutdown()
    # drops the process group: vLLM's exit-time finalizer would otherwise print a traceback after
    # the `error:` line. Split: the rollout group is released (told to stop) the same way.
    judge = roles.reward_model if hasattr(roles.reward_model, "close") else None  # a judge's engine: the same
    with roles.rollout or contextlib.nullcontext(), roles.episodes or contextlib.nullcontext(), \
            roles.agents or contextlib.nullcontext(), judge or contextlib.nullcontext():
        trainer = RLTrainer(cfg, ctx, roles, placement)
        with placement.session(trainer.roles):
            summary = trainer.fit()
    return finish(cfg, ctx, "rl", summary, requeue=trainer.requeue)
