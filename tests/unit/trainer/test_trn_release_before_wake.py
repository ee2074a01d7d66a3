"""Memory an offload frees goes back to torch's caching allocator, not to the driver, and vLLM's
wake maps memory of its own: on a GPU the cached blocks must be released before each wake. The
GPU is stubbed (has_gpu true, torch.cuda's calls recorded) and the order of events asserted."""
import torch

from verl_hpc.rollout.engine import KV_CACHE, WEIGHTS
from verl_hpc.runtime import device as devices
from verl_hpc.trainer.stages.rollout_weights import RolloutWeights


class FakeRollout:
    weights_dropped = False

    def __init__(self, events):
        self.events = events

    def wake(self, tags):
        self.events.append(f"wake {','.join(tags)}")


def test_offload_release_wake_order_on_a_gpu(monkeypatch):
    events = []
    monkeypatch.setattr(devices, "has_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))

    def sync(actor, rollout):  # the actor resident for the sync, offloaded when it ends
        events.extend(["sync", "actor offloaded"])
        return {"sync/seconds": 0.0}

    weights = RolloutWeights(actor=object(), rollout=FakeRollout(events), weight_sync=sync)
    events.append("update offloaded the actor")
    weights.ready()
    assert events == ["update offloaded the actor", "synchronize", "empty_cache", f"wake {WEIGHTS}",
                      "sync", "actor offloaded", "synchronize", "empty_cache", f"wake {KV_CACHE}"]


def test_nothing_is_released_on_cpu(monkeypatch):
    events = []
    monkeypatch.setattr(devices, "has_gpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    weights = RolloutWeights(actor=object(), rollout=FakeRollout(events), weight_sync=lambda a, r: {})
    weights.ready()
    assert events == [f"wake {WEIGHTS}", f"wake {KV_CACHE}"]
