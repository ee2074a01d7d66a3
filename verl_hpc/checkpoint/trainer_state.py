"""The RL trainer's checkpointer: what a training checkpoint holds, when it is written, how a run
resumes from one (storage: docs/checkpoints.md). What happens after a signal's checkpoint (requeue or
stop) is runtime/requeue.py's.

    ckpt = TrainerCheckpointer(cfg, ctx, roles, loader=..., kl_ctrl=..., guard=...)
    start = ckpt.resume()              # 0 (fresh) or the step of the checkpoint loaded
    for step in range(start + 1, total + 1):
        ...; ckpt.maybe_save(step)     # checkpoint.save_every, and always at the last step
        if ckpt.stop_if_preempted(step): break   # the preemption flag: save now and stop
    ckpt.close()
    ckpt.requeue_if_preempted()        # after the summary: requeue (SystemExit) or log how to resume

The RL trainer (trainer/rl.py) and preference training (trainer/preference.py, its own FORMAT so
neither resumes from the other's checkpoints) share this class and hence the signal handling.

Memory: a save reads and a load writes the engines' parameters and optimizer states, which the
engines make resident for it (offload: `resident("state")`, no gradient buffers). The RL trainer
passes `before_state`, which puts the rollout engine to sleep first (a validation may have woken
it), so vLLM's weights and KV cache are never mapped beside them, and `after_load`, which marks
the rollout's weights stale (trainer/rollout_weights.py).

What a checkpoint holds:
- tensors: the engine state of the actor, (PPO) the critic and (PRIME) the implicit PRM, names
  prefixed `actor/`, `critic/`, `prm/` (`actor/model/...`, `actor/optim/exp_avg/...`; layout
  independent, see engines/base.py). The reference policy, a reward model and a frozen PRM
  (prm.update = none) are not trained and are rebuilt from their folders.
- metadata (rank 0's): `config` (resolved YAML), `trainer_state` = {step, engines: {role: engine
  meta (LR scheduler, optimizer step, ...)}, loader (sampler position), kl_ctrl, guard counters,
  metrics: {file, step} (the JSONL history up to `step`; the tracker drops later rows on resume)}.
- rank_state: each rank's RNG states (python, numpy, torch CPU, CUDA, Megatron's RNG tracker,
  the trainer generator). Rollout sampling does not depend on them (seeded per step), but
  anything else random does. Rank 0's also holds the metric history up to the step
  (verl_hpc.tracking.history), put back on resume where the output directory lacks it.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from verl_hpc.checkpoint.async_save import AsyncSaver
from verl_hpc.checkpoint.index import find_latest, resolve
from verl_hpc.checkpoint.load import open_checkpoint
from verl_hpc.checkpoint.namespace import KEY as NAMESPACE_KEY, check_namespace
from verl_hpc.checkpoint.publish import STEP_DIR, list_checkpoints
from verl_hpc.checkpoint.rng import capture_rng_state, restore_rng_state
from verl_hpc.checkpoint.save import save_checkpoint
from verl_hpc.checkpoint.sharded import ShardedTensor
from verl_hpc.config import to_yaml
from verl_hpc.config.layout import Layout
from verl_hpc.tracking.history import MetricHistory

log = logging.getLogger(__name__)

TRAINED_ROLES = ("actor", "critic", "prm")
FORMAT = "verl_hpc.rl_trainer/1"
PREFERENCE_FORMAT = "verl_hpc.preference_trainer/1"


def _prefixed(prefix: str, tensors) -> list:
    """The same slabs (sharing storage) under `prefix/`: loads fill the engine's tensors in place."""
    return [ShardedTensor(f"{prefix}/{t.name}", t.local, t.global_shape, t.offsets) for t in tensors]


class TrainerCheckpointer:
    def __init__(self, cfg, ctx, roles, *, loader=None, kl_ctrl=None, guard=None, task_weights=None,
                 rollback=None, fmt: str = FORMAT, total_steps: Optional[int] = None,
                 before_state: Optional[Callable[[], None]] = None,
                 after_load: Optional[Callable[[], None]] = None) -> None:
        """roles: anything with `actor` (and optionally `critic`, `prm`) attributes holding `.engine`;
        loader: anything with state_dict()/load_state_dict() (the data position); task_weights,
        rollback: trainer/task_weights.py and trainer/rollback.py state; fmt: the trainer_state
        format a resume insists on; total_steps: the run's last step (default trainer.total_steps;
        preference training derives it from the epochs); before_state / after_load: called before
        the engines' state is read or written, and after a load (see the module docstring)."""
        self.cfg, self.ctx, self.roles = cfg, ctx, roles
        self.before_state = before_state or (lambda: None)
        self.after_load = after_load or (lambda: None)
        self.loader, self.kl_ctrl, self.guard = loader, kl_ctrl, guard
        self.task_weights, self.rollback = task_weights, rollback
        self.format = fmt
        c = cfg.checkpoint
        self.root = Path(c.dir)
        self.save_every, self.keep_last = int(c.save_every), int(c.keep_last)
        self.total_steps = int(cfg.trainer.total_steps if total_steps is None else total_steps)
        self.layout = {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp,
                       "dp": Layout(ctx.world_size, cfg.parallel.tp, cfg.parallel.pp).dp}
        self.history = MetricHistory(cfg.trainer.output_dir)  # carried by rank 0's rank_state
        self.last_saved: Optional[int] = None
        self.preempted_at: Optional[int] = None
        self._async = None
        if c.async_save:  # collective (own gloo group): every rank builds its checkpointer
            self._async = AsyncSaver(self.root, keep_last=self.keep_last, layout=self.layout,
                                     timeout_s=cfg.trainer.collective_timeout_s)

    # ------------------------------------------------------------------------------ saving
    def _engines(self) -> Dict[str, Any]:
        roles = {n: getattr(self.roles, n, None) for n in TRAINED_ROLES}
        # a frozen PRM (prm.update = none) has no optimizer and is rebuilt from its folder
        return {n: r.engine for n, r in roles.items()
                if r is not None and (n != "prm" or r.engine.optimizer is not None)}

    def due(self, step: int) -> bool:
        return step == self.total_steps or (self.save_every > 0 and step % self.save_every == 0)

    def maybe_save(self, step: int, *, force: bool = False) -> Optional[str]:
        """Save after `step` if it is due (or `force`); collective. Returns the path (async: the
        path it will have once committed) or None."""
        if self.last_saved == step:
            return str(self.root / f"step_{step:06d}")
        if not (force or self.due(step)):
            return None

        t0 = time.perf_counter()
        tensors, engine_meta = [], {}
        self.before_state()  # e.g. the rollout asleep: the engines make their state resident next
        for name, engine in self._engines().items():
            st = engine.state()
            tensors += _prefixed(name, st.tensors)
            engine_meta[name] = st.meta
        if self.last_saved is None:  # first save of this process: not into another namespace's folder
            check_namespace(self.root, self.cfg.trainer.namespace, "save into")
        metadata = {"config": self._config_yaml(), "trainer_state": self._trainer_state(step, engine_meta),
                    NAMESPACE_KEY: self.cfg.trainer.namespace}
        rank_state = capture_rng_state(generators={"trainer": self.ctx.generator})
        if self.ctx.rank == 0:
            rank_state.update(self.history.snapshot(step))  # empty without the jsonl backend
        if self._async is not None and not force:
            self._async.save(step, tensors, metadata=metadata, rank_state=rank_state)
            path = self.root / f"step_{step:06d}"
            how = f"async, blocked {self._async.last_blocked_s:.2f}s"
        else:
            if self._async is not None:  # a forced save (preemption) is committed before we go on
                self._async.wait()
            path = save_checkpoint(self.root, step, tensors, metadata=metadata, rank_state=rank_state,
                                   layout=self.layout, keep_last=self.keep_last)
            how = f"{time.perf_counter() - t0:.2f}s"
        self.last_saved = step
        if self.ctx.rank == 0:
            log.info("checkpoint: step %d -> %s (%s)", step, path, how)
        return str(path)

    def _config_yaml(self) -> str:
        return to_yaml(self.cfg)

    def _trainer_state(self, step: int, engine_meta: dict) -> dict:
        metrics_file = self.history.path
        return {"format": self.format, "step": int(step), "engines": engine_meta,
                "loader": self.loader.state_dict() if self.loader is not None else None,
                "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                "guard": {"in_a_row": self.guard.in_a_row, "total": self.guard.total} if self.guard else None,
                "task_weights": self.task_weights.state_dict() if self.task_weights is not None else None,
                "rollback": self.rollback.state_dict() if self.rollback is not None else None,
                "metrics": {"file": str(metrics_file), "step": int(step)}}

    def close(self) -> None:
        """Wait for an async save in flight (before the process group goes away)."""
        if self._async is not None:
            self._async.wait()

    # ------------------------------------------------------------------------------ preemption
    def stop_if_preempted(self, step: int) -> bool:
        """At a step boundary, after maybe_save(step): if any rank saw Slurm's warning signal or
        SIGTERM (runtime/signals.py; one all-reduce), save `step` now and return True (the loop
        stops). Collective: every rank calls it after every step."""
        if not self.ctx.preemption.agreed():
            return False
        log.warning("%s: preemption flag set after step %d; saving and stopping", self.cfg.trainer.job, step)
        self.maybe_save(step, force=True)
        self.preempted_at = step
        return True

    def requeue_if_preempted(self) -> None:
        """After a stop_if_preempted stop: requeue the Slurm job (SystemExit on every rank) or log how
        to resume, per runtime/requeue.py's rule. Nothing when the run was not preempted. Collective."""
        if self.preempted_at is None:
            return
        from verl_hpc.runtime.requeue import requeue_after_signal

        requeue_after_signal(self.cfg, self.ctx, step=self.preempted_at, checkpoint_dir=self.root)

    # ------------------------------------------------------------------------------ resuming
    def find(self) -> Optional[Path]:
        """The checkpoint `trainer.resume` asks for: auto -> `latest` under checkpoint.dir (None:
        a fresh start), never -> None, anything else -> that path (which must exist)."""
        how = str(self.cfg.trainer.resume or "auto")
        if how == "never":
            return None
        if how == "auto":
            return find_latest(self.root)
        return resolve(how)

    def resume(self) -> int:
        """Load the checkpoint `trainer.resume` names into the engines and the trainer's state;
        returns its step (0 for a fresh start). Every rank calls this."""
        path = self.find()
        check_namespace(path or self.root, self.cfg.trainer.namespace, "resume from" if path else "save into")
        if path is None:
            self._check_no_collisions(0)
            if self.ctx.rank == 0:
                log.info("resume: trainer.resume=%s and no checkpoint under %s: starting fresh",
                         self.cfg.trainer.resume, self.root)
            return 0
        t0 = time.perf_counter()
        ts = self.load(path)
        if self.rollback is not None and ts.get("rollback"):  # rollbacks so far, best values, LR factor
            self.rollback.load_state_dict(ts["rollback"])
        step = int(ts["step"])
        self._check_no_collisions(step)
        self.last_saved = step
        if self.ctx.rank == 0:
            log.info("resume: loaded %s (step %d) in %.2fs; continuing at step %d", path, step,
                     time.perf_counter() - t0, step + 1)
        return step

    def load(self, path) -> dict:
        """Load a checkpoint into the engines, the RNGs, the loader, the KL controller, the guard and the
        task weights; returns its trainer_state. Every rank calls this (resume, and the rollback guard's
        rollback, which keeps its own counters)."""
        self.before_state()
        with open_checkpoint(path) as reader:
            ts = reader.metadata.get("trainer_state") or {}
            if ts.get("format") != self.format:
                raise ValueError(f"{path}: not a checkpoint of this trainer (trainer_state.format="
                                 f"{ts.get('format')!r}, expected {self.format!r}: trainer.job must match "
                                 "the run that saved it); trainer.resume=never starts fresh")
            for name, engine in self._engines().items():
                if name not in ts["engines"]:
                    raise ValueError(f"{path} has no {name} state (saved roles: {sorted(ts['engines'])}); "
                                     "the algorithm must match the run that saved it")
                engine.load_state(lambda slabs, n=name: reader.load_into(_prefixed(n, slabs)),
                                  ts["engines"][name])
            if self.ctx.rank == 0:
                self.history.restore(reader.rank_state(0), int(ts["step"]))
            if reader.world_size == self.ctx.world_size:
                restore_rng_state(reader.rank_state(self.ctx.rank), generators={"trainer": self.ctx.generator})
            elif self.ctx.rank == 0:
                log.warning("resume: saved by %d ranks, running on %d: per-rank RNG states not restored",
                            reader.world_size, self.ctx.world_size)
        if self.loader is not None and ts.get("loader") is not None:
            self.loader.load_state_dict(ts["loader"])
        if self.kl_ctrl is not None and ts.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(ts["kl_ctrl"])
        if self.guard is not None and ts.get("guard"):
            self.guard.in_a_row, self.guard.total = int(ts["guard"]["in_a_row"]), int(ts["guard"]["total"])
        if self.task_weights is not None:
            if not ts.get("task_weights"):
                raise ValueError(f"{path}: saved without data.tasks, but this run has tasks "
                                 f"{self.task_weights.tasks}; resume with the data settings it was saved with")
            self.task_weights.load_state_dict(ts["task_weights"])
        self.after_load()
        return ts

    def _check_no_collisions(self, start: int) -> None:
        """Fail now, not at the first save hours later, when checkpoint.dir already holds steps
        this run would save again (an earlier run's, with trainer.resume=never or a path to an
        older step): a step is saved once."""
        taken = sorted(p.name for p in list_checkpoints(self.root)
                       if start < int(STEP_DIR.match(p.name).group(1)) <= self.total_steps)
        if taken:
            raise ValueError(
                f"checkpoint.dir={self.root} already holds {', '.join(taken)} from an earlier run, "
                f"which this run (steps {start + 1}..{self.total_steps}, trainer.resume="
                f"{self.cfg.trainer.resume}) would save again: set another checkpoint.dir, remove "
                "them, or resume from the latest (trainer.resume=auto)")

