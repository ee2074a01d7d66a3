"""Split placement (placement.mode = split, docs/async.md): the training ranks' side (batches from
the rollout group's stream, weights published to it) and the rollout ranks' (they serve it)."""
from __future__ import annotations

from typing import Callable, Dict

from verl_hpc.runtime.split import STOP


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
        from verl_hpc.trainer.placement.async_link import AsyncLink
        from verl_hpc.trainer.placement.remote import RemoteRollout

        self.link = AsyncLink(self.cfg, self.ctx)
        self.source = self.link.next_batch
        self.steps_done = steps_done
        roles.rollout = RemoteRollout(self.link, steps_done)

    def loader(self, make_loader):
        return None  # the data stream is the rollout leader's

    def weights(self, actor, roles, make_sync):
        from verl_hpc.trainer.placement.remote import PublishedWeights

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
        from verl_hpc.trainer.placement import rollout_worker

        return rollout_worker.run(self.cfg, self.ctx)


def _release_rollout(ctx) -> None:
    """A split job's trainer that fails before its link exists still lets the rollout group go."""
    if ctx.split.is_leader:
        try:
            ctx.split.mailbox.put(STOP, True)
        except Exception:  # noqa: BLE001 - the error in flight is the one to report
            pass
