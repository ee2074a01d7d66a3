"""A training program's checkpointer: what a training checkpoint holds, when it is written, how a
run resumes from one (storage: docs/checkpoints.md). It names no object of the programs: they
hand it what they have, by name, when they build it (torchtitan's way).

    ckpt = Checkpointer(options, ctx, engines={"policy": engine}, states={"data": sampler},
                        fmt="my_program/1")
    start = ckpt.resume()              # 0 (fresh) or the step of the checkpoint loaded
    for step in range(start + 1, total + 1):
        ...; ckpt.maybe_save(step)     # checkpoint.save_every, and always at the last step
        if ckpt.stop_if_preempted(step): break   # the preemption flag: save now and stop
    ckpt.close()                       # an async save in flight is committed

What happens after a signal's checkpoint (requeue or stop) is the program's (runtime/requeue.py,
with `preempted_at`).

Two kinds of named objects:
- engines: anything with `state()` -> EngineState (tensors + meta) and `load_state(fill, meta)`
  (engines/base.py). Their tensors go into the checkpoint's files under `<name>/` (layout
  independent); their meta into `trainer_state.engines.<name>`.
- states: anything with `state_dict()` -> JSON-able value and `load_state_dict(value)`. Each goes
  into rank 0's metadata as `trainer_state.<name>` (the data position, a KL controller's value,
  counters). `state_dict()` is called on every rank at every save (it may be collective); the
  metadata kept is rank 0's, and every rank loads it. An object whose state a resume cannot do
  without has a `required_state` string: the hint given when a checkpoint lacks it.

Memory: a save reads and a load writes the engines' parameters and optimizer states, which the
engines make resident for it. `before_state` runs first (the RL program puts the rollout engine to
sleep, so vLLM's memory is never mapped beside them) and `after_load` after a load (it marks the
rollout's weights stale).

What a checkpoint holds:
- tensors: each engine's state under its name (`actor/model/...`, `actor/optim/exp_avg/...`).
- metadata (rank 0's): `config` (the resolved YAML), the namespace, `trainer_state` = {format,
  step, engines: {name: meta}, <state name>: <state> ..., metrics: {file, step}}.
- rank_state: each rank's RNG states (python, numpy, torch CPU, CUDA, Megatron's RNG tracker, the
  run's generator); rank 0's also holds the metric history up to the step, put back on resume
  where the output directory lacks it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from verl_hpc.checkpoint.async_save import AsyncSaver
from verl_hpc.checkpoint.errors import CheckpointMismatchError
from verl_hpc.checkpoint.index import find_latest, resolve
from verl_hpc.checkpoint.load import open_checkpoint
from verl_hpc.checkpoint.namespace import KEY as NAMESPACE_KEY, check_namespace
from verl_hpc.checkpoint.publish import STEP_DIR, list_checkpoints
from verl_hpc.checkpoint.rng import capture_rng_state, restore_rng_state
from verl_hpc.checkpoint.save import save_checkpoint
from verl_hpc.checkpoint.sharded import ShardedTensor
from verl_hpc.runtime import faults

log = logging.getLogger(__name__)

# trainer_state keys of the checkpointer's own; a registered state may not take them
RESERVED = ("format", "step", "engines", "metrics")


@dataclass(frozen=True)
class CheckpointOptions:
    """What the checkpointer needs from the job's configuration (built by the program)."""
    dir: str  # checkpoint.dir
    save_every: int = 0  # checkpoint.save_every (0: only the last step and preemption)
    keep_last: int = 0  # checkpoint.keep_last (0: keep all)
    async_save: bool = False  # checkpoint.async_save
    resume: str = "auto"  # trainer.resume: auto, never or a path
    namespace: str = ""  # trainer.namespace
    total_steps: int = 0  # the run's last step: always saved
    timeout_s: float = 600.0  # the async saver's collectives (trainer.collective_timeout_s)
    layout: Optional[Mapping[str, int]] = None  # {tp, pp, dp}: recorded in the index
    program: str = "training"  # named in log lines


def _prefixed(prefix: str, tensors) -> list:
    """The same slabs (sharing storage) under `prefix/`: loads fill the engine's tensors in place."""
    return [ShardedTensor(f"{prefix}/{t.name}", t.local, t.global_shape, t.offsets) for t in tensors]


class RoleLoader:
    """What an engine's `load_state` is handed for the engine saved under `role/`: called with the
    engine's slabs, it fills them from `role/<name>`; `stored()` lists what the checkpoint holds
    for the role ({name without the prefix: global shape}), so that the engine can refuse a
    checkpoint of another model, naming the tensor, before it changes anything (a checkpoint
    with MORE tensors than the model asks for would otherwise load without a word)."""

    def __init__(self, reader, role: str) -> None:
        self.reader, self.role = reader, role

    def __call__(self, slabs) -> None:
        self.reader.load_into(_prefixed(self.role, slabs))

    def stored(self) -> dict:
        prefix = f"{self.role}/"
        return {n[len(prefix):]: t.global_shape for n, t in self.reader.tensors().items() if n.startswith(prefix)}

    @property
    def where(self) -> str:
        return f"{self.reader.path} ({self.role})"


class Checkpointer:
    def __init__(self, options: CheckpointOptions, ctx, *, engines: Mapping[str, Any], fmt: str,
                 states: Optional[Mapping[str, Any]] = None, config_yaml: Callable[[], str] = lambda: "",
                 history=None, before_state: Optional[Callable[[], None]] = None,
                 after_load: Optional[Callable[[], None]] = None) -> None:
        """engines, states: the named objects (module docstring); fmt: the trainer_state format a
        resume insists on (a program resumes only from its own); config_yaml: the resolved config,
        stored in the metadata; history: a MetricHistory (tracking/history.py) or None;
        before_state / after_load: see the module docstring."""
        states = dict(states or {})
        clash = sorted(set(states) & set(RESERVED))
        if clash:
            raise ValueError(f"checkpointer: state names {clash} are the checkpointer's own")
        self.options, self.ctx, self.format = options, ctx, fmt
        self.engines, self.states = dict(engines), states
        self.config_yaml, self.history = config_yaml, history
        self.before_state = before_state or (lambda: None)
        self.after_load = after_load or (lambda: None)
        self.root = Path(options.dir)
        self.save_every, self.keep_last = int(options.save_every), int(options.keep_last)
        self.total_steps = int(options.total_steps)
        self.layout = dict(options.layout or {})
        self.last_saved: Optional[int] = None
        self.preempted_at: Optional[int] = None
        self._async = None
        if options.async_save:  # collective (own gloo group): every rank builds its checkpointer
            self._async = AsyncSaver(self.root, keep_last=self.keep_last, layout=self.layout,
                                     timeout_s=options.timeout_s)

    # ------------------------------------------------------------------------------ saving
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
        for name, engine in self.engines.items():
            st = engine.state()
            tensors += _prefixed(name, st.tensors)
            engine_meta[name] = st.meta
        if self.last_saved is None:  # first save of this process: not into another namespace's folder
            check_namespace(self.root, self.options.namespace, "save into")
        metadata = {"config": self.config_yaml(), "trainer_state": self._trainer_state(step, engine_meta),
                    NAMESPACE_KEY: self.options.namespace}
        rank_state = capture_rng_state(generators={"trainer": self.ctx.generator})
        if self.ctx.rank == 0 and self.history is not None:
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

    def _trainer_state(self, step: int, engine_meta: dict) -> dict:
        out = {"format": self.format, "step": int(step), "engines": engine_meta}
        out.update({name: obj.state_dict() for name, obj in self.states.items()})
        if self.history is not None:
            out["metrics"] = {"file": str(self.history.path), "step": int(step)}
        return out

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
        log.warning("%s: preemption flag set after step %d; saving and stopping", self.options.program, step)
        self.maybe_save(step, force=True)
        self.preempted_at = step
        return True

    # ------------------------------------------------------------------------------ resuming
    def find(self) -> Optional[Path]:
        """The checkpoint `trainer.resume` asks for: auto -> `latest` under checkpoint.dir (None:
        a fresh start), never -> None, anything else -> that path (which must exist). A relaunch
        after a rank died (an in-allocation restart: VERL_HPC_ATTEMPT > 0) takes `latest` where it
        is past that start: any step there above it was saved by this job, the first launch having
        refused checkpoint.dir's later steps of another run (_check_no_collisions)."""
        how = str(self.options.resume or "auto")
        if how == "auto":
            return find_latest(self.root)
        start = None if how == "never" else resolve(how)
        if faults.attempt() > 0:
            latest = find_latest(self.root)
            if latest is not None and _step_of(latest) > (_step_of(start) if start is not None else 0):
                if self.ctx.rank == 0:
                    log.info("resume: relaunch %d of this job: from %s, its latest checkpoint (trainer.resume=%s "
                             "named the first launch's start)", faults.attempt(), latest, how)
                return latest
        return start

    def resume(self) -> int:
        """Load the checkpoint `trainer.resume` names into the engines and the states; returns its
        step (0 for a fresh start). Every rank calls this."""
        path = self.find()
        check_namespace(path or self.root, self.options.namespace, "resume from" if path else "save into")
        if path is None:
            self._check_no_collisions(0)
            if self.ctx.rank == 0:
                log.info("resume: trainer.resume=%s and no checkpoint under %s: starting fresh",
                         self.options.resume, self.root)
            return 0
        t0 = time.perf_counter()
        ts = self.load(path)
        step = int(ts["step"])
        self._check_no_collisions(step)
        self.last_saved = step
        if self.ctx.rank == 0:
            then = (f"the run's last step ({self.total_steps}): nothing left to do" if 0 < self.total_steps <= step
                    else f"continuing at step {step + 1}")
            log.info("resume: loaded %s (step %d) in %.2fs; %s", path, step, time.perf_counter() - t0, then)
        return step

    def load(self, path) -> dict:
        """Load a checkpoint into the engines, the RNGs and every registered state; returns its
        trainer_state. Every rank calls this (resume, and a rollback to an earlier step)."""
        self.before_state()
        with open_checkpoint(path) as reader:
            ts = reader.metadata.get("trainer_state") or {}
            if ts.get("format") != self.format:
                raise CheckpointMismatchError(
                    f"{path}: not a checkpoint of this program (trainer_state.format={ts.get('format')!r}, "
                    f"expected {self.format!r}: trainer.job must match the run that saved it); "
                    "trainer.resume=never starts fresh")
            for name, engine in self.engines.items():
                if name not in ts["engines"]:
                    raise CheckpointMismatchError(
                        f"{path} has no {name} state (saved roles: {sorted(ts['engines'])}); "
                        "the algorithm must match the run that saved it")
                engine.load_state(RoleLoader(reader, name), ts["engines"][name])
            if self.ctx.rank == 0 and self.history is not None:
                self.history.restore(reader.rank_state(0), int(ts["step"]))
            if reader.world_size == self.ctx.world_size:
                restore_rng_state(reader.rank_state(self.ctx.rank), generators={"trainer": self.ctx.generator})
            elif self.ctx.rank == 0:
                log.warning("resume: saved by %d ranks, running on %d: per-rank RNG states not restored",
                            reader.world_size, self.ctx.world_size)
        for name, obj in self.states.items():
            state = ts.get(name)
            if state is None:  # saved by a run without it (or by a version that did not keep it)
                hint = getattr(obj, "required_state", None)
                if hint:
                    raise CheckpointMismatchError(f"{path}: saved without {name} state, which this run keeps; {hint}")
                continue
            obj.load_state_dict(state)
        self.after_load()
        return ts

    def _check_no_collisions(self, start: int) -> None:
        """Fail now, not at the first save hours later, when checkpoint.dir already holds steps
        this run would save again (an earlier run's, with trainer.resume=never or a path to an
        older step): a step is saved once."""
        taken = sorted(p.name for p in list_checkpoints(self.root)
                       if start < int(STEP_DIR.match(p.name).group(1)) <= self.total_steps)
        if taken:
            raise CheckpointMismatchError(
                f"checkpoint.dir={self.root} already holds {', '.join(taken)} from an earlier run, "
                f"which this run (steps {start + 1}..{self.total_steps}, trainer.resume="
                f"{self.options.resume}) would save again: set another checkpoint.dir, remove "
                "them, or resume from the latest (trainer.resume=auto)")


def _step_of(path: Path) -> int:
    """The step of a checkpoint folder `step_<N>` (0 for a folder named otherwise)."""
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else 0
