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
(trainer/stages/rollout_weights.py); the loader's position is the checkpoint's data state.

Split (placement.mode = split, docs/async.md): the training ranks take batches from the rollout
group's stream (trainer/placement/async_link.py), publish weights to it after each update
(trainer/placement/remote.py), and the checkpoint holds the link's state (the rollout's data cursor,
the batch in flight, the batches generated but not trained). Its rollout ranks run
trainer/placement/rollout_worker.py instead of the trainer.
"""
from __future__ import annotations

from typing import Callable, Dict, Protocol

from verl_hpc.trainer.placement.colocated import Colocated
from verl_hpc.trainer.placement.split import SplitRollout, SplitTrainer

__all__ = ["Colocated", "Placement", "SplitRollout", "SplitTrainer", "choose"]


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


def choose(cfg, ctx):
    """The placement of this rank, per placement.mode and the rank's group."""
    if not cfg.placement.split:
        return Colocated(cfg, ctx)
    return SplitRollout(cfg, ctx) if ctx.role == "rollout" else SplitTrainer(cfg, ctx)
