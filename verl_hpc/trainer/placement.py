"""Where generation runs relative to training (`placement.mode`), as one small interface chosen once.

    placement = choose(cfg, ctx)                  # Colocated, SplitTrainer or SplitRollout
    return placement.run_rank(lambda: train(placement))  # a split job's rollout ranks serve instead
    placement.attach(roles, steps_done)           # the trainer's roles see the rollout it has
    placement.loader(make_loader)                 # where batches come from: a PromptLoader here, or none
    placement.source                              # StepSampler's source (None: generate here)
    placement.weights(actor, roles, make_sync)    # where weights go: RolloutWeights' interface
    placement.checkpoint_state(loader)            # what a checkpoint holds as the data position
    placement.start(step); placement.summary()    # after resume; what the summary adds

Colocated (placement.mode = colocated): the rollout engine lives on the training ranks; rank 0
samples prompts from its PromptLoader; the actor's weights are synced into the rollout lazily
(trainer/rollout_weights.py); the loader's position is the checkpoint's data state.

Split (placement.mode = split, docs/async.md): the training ranks take batches from the rollout
group's stream (trainer/loops/async_link.py), publish weights to it after each update
(trainer/loops/remote.py), and the checkpoint holds the link's state (the rollout's data cursor,
the batch in flight, the batches generated but not trained). Its rollout ranks run
trainer/loops/rollout_worker.py instead of the trainer.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Protocol

from verl_hpc.runtime.split import STOP


class Placement(Protocol):
    """What the RL program asks of a placement (module docstring); Colocated and SplitTrainer
    implement all of it, SplitRollout only run_rank."""

    builds_rollout: bool
    source: object  # StepSampler's source, or None: generate here

    def run_rank(self, train: Callable[[], dict]) -> dict: ...
    def attach(self, roles, steps_done: Callable[[], int]) -> None: ...
    def loader(self, make_loader: Callable[[], object]): ...
    def weights(self, actor, roles, make_sync: Callable[[], object]): ...
    def checkpoint_state(self, loader): ...
    def session(self, roles): ...
    def start(self, step: int) -> None: ...
    def timed_metrics(self, metrics: Dict[str, float]) -> None: ...
    def summary(self) -> Dict: ...


class Colocated:
    """Generation and training on the same ranks."""

    builds_rollout = True  # build_roles builds the rollout engine on these ranks
    source = None  # StepSampler generates here

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx

    def run_rank(self, train: Callable[[], dict]) -> dict:
        return train()

    def attach(self, roles, steps_done: Callable[[], int]) -> None:
        """Nothing to replace: roles.rollout is the local engine."""

    def loader(self, make_loader: Callable[[], object]):
        return make_loader() if self.ctx.rank == 0 else None  # rank 0 samples and broadcasts

    def weights(self, actor, roles, make_sync):
        from verl_hpc.trainer.rollout_weights import RolloutWeights

        weights = RolloutWeights(actor, roles.rollout, make_sync())
        roles.verify = weights.check_generated  # LoRA adapter sync: the generation used the update
        return weights

    def checkpoint_state(self, loader):
        return loader

    def session(self, roles):
        return contextlib.nullcontext()

    def start(self, step: int) -> None:
        pass

    def timed_metrics(self, metrics: Dict[str, float]) -> None:
        pass

    def summary(self) -> Dict:
        return {}


class SplitTrainer:
    """The training ranks of a split job: batches from the rollout group, weights to it."""

    builds_rollout = False
    source = None

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.link = None

    def run_rank(self, train: Callable[[], dict]) -> dict:
        try:
            return train()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """A trainer failing before its link could tell the rollout group to stop still lets it go."""
        if self.link is None:
            _release_rollout(self.ctx)
        elif not self.link.stopped:  # built, but the trainer failed before its session began
            try:
                self.link.stop()
            except Exception:  # noqa: BLE001 - the error in flight is the one to report
                pass

    def attach(self, roles, steps_done: Callable[[], int]) -> None:
        from verl_hpc.trainer.loops.async_link import AsyncLink
        from verl_hpc.trainer.loops.remote import RemoteRollout

        self.link = AsyncLink(self.cfg, self.ctx)
        self.source = self.link.next_batch
        self.steps_done = steps_done
        roles.rollout = RemoteRollout(self.link, steps_done)

    def loader(self, make_loader):
        return None  # the data stream is the rollout leader's

    def weights(self, actor, roles, make_sync):
        from verl_hpc.trainer.loops.remote import PublishedWeights

        # published to the rollout group, which takes the newest between its generation chunks
        return PublishedWeights(self.link, actor, self.steps_done)

    def checkpoint_state(self, loader):
        return self.link  # the rollout's cursor, the batch in flight, the batches not trained yet

    def session(self, roles):
        return roles.rollout  # RemoteRollout: closing it tells the rollout group to stop

    def start(self, step: int) -> None:
        self.link.start(step)  # the rollout group begins (or continues what the checkpoint held)

    def timed_metrics(self, metrics: Dict[str, float]) -> None:
        """The training group's wait on the rollout group."""
        if "timing_s/wait_rollout" in metrics:
            step_s = max(metrics["timing_s/step"], 1e-9)
            busy = max(metrics["timing_s/step"] - metrics["timing_s/wait_rollout"], 1e-9)
            metrics["async/idle_frac/train"] = metrics["timing_s/wait_rollout"] / step_s
            metrics["async/tokens_per_s/train"] = metrics.get("train/tokens", 0.0) / busy

    def summary(self) -> Dict:
        return {"trained_prompt_ids": list(self.link.trained_ids)}  # what this process trained on, in order


class SplitRollout:
    """The rollout ranks of a split job: they generate for the training group, nothing else."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx

    def run_rank(self, train) -> dict:
        from verl_hpc.trainer.loops import rollout_worker

        return rollout_worker.run(self.cfg, self.ctx)


def choose(cfg, ctx):
    """The placement of this rank, per placement.mode and the rank's group."""
    if not cfg.placement.split:
        return Colocated(cfg, ctx)
    return SplitRollout(cfg, ctx) if ctx.role == "rollout" else SplitTrainer(cfg, ctx)


def _release_rollout(ctx) -> None:
    """A split job's trainer that fails before its link exists still lets the rollout group go."""
    if ctx.split.is_leader:
        try:
            ctx.split.mailbox.put(STOP, True)
        except Exception:  # noqa: BLE001 - the error in flight is the one to report
            pass

