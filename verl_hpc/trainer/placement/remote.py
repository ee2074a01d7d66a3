"""The rollout as the training ranks see it in split placement: weights go out, generations come back.

    weights = PublishedWeights(link, actor, steps_done)   # RolloutWeights' interface
    rollout = RemoteRollout(link, steps_done)             # RolloutEngine's generate, for validation

`steps_done()` is the trainer's policy version (steps completed). The weights are published right
after each update (`mark_stale`), and `ready()` publishes them whenever the rollout group's newest
version is still older than that, so that even a step that
trained on nothing (every group filtered out) moves the version on and the rollout's gate
(batch s needs version >= s - 1 - k) never waits for an update that will not come.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict

from verl_hpc.runtime.split import GroupLostError

log = logging.getLogger(__name__)


class PublishedWeights:
    def __init__(self, link, actor, steps_done: Callable[[], int]):
        self.link, self.actor, self.steps_done = link, actor, steps_done
        self._unreported: Dict[str, float] = {}

    def ready(self, timer=None) -> None:
        version = self.steps_done()
        if version > self.link.publisher.version:
            with (timer("sync") if timer else contextlib.nullcontext()):
                self._unreported = self.link.publish(self.actor, version)

    def pop_metrics(self) -> Dict[str, float]:
        out, self._unreported = self._unreported, {}
        return out

    def mark_stale(self) -> None:
        """The update is done: publish now, not at the next step's ready(), so the rollout's gate
        opens while this step logs, validates and checkpoints (its sync/* go with the next step)."""
        self.ready()

    def unchanged(self) -> None:
        """A step that trained nothing (PRIME's warm-up): the version moves on with the same
        weights, published, else the rollout group's gate would wait for it."""
        self.ready()

    def park(self) -> None:
        """No rollout engine on a training rank."""

    def new_step(self, step: int) -> None:
        """No engine here to rebuild: the rollout group's faults end its rank (docs/resilience.md)."""

    def pop_recovery(self) -> Dict[str, float]:
        return {}


class RemoteRollout:
    """generate() by the rollout group, with the trainer's current weights; the rest a no-op."""

    name = "remote rollout"
    weights_dropped = False
    asleep = False

    def __init__(self, link, steps_done: Callable[[], int]):
        self.link, self.steps_done = link, steps_done

    def generate(self, prompts, sampling, media=None):
        """media: the rollout interface's prompt images, which the link does not carry (a
        vision-language model in split placement is refused by the config check)."""
        if media is not None:
            raise ValueError("split placement: the rollout ranks do not receive prompt images")
        return self.link.generate(prompts, sampling, self.steps_done())

    def sleep(self) -> None:
        pass

    def wake(self, tags=None) -> None:
        pass

    def close(self) -> None:
        self.link.stop()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: the rollout group may be the one that died (its leader serves the
        # job's store, so telling it to stop fails too); that error is the one to report, not
        # a second one about the stop message.
        try:
            self.close()
        except GroupLostError as e:
            log.warning("split placement: could not tell the rollout group to stop: %s", e)
