"""The staged wake of vLLM's sleep mode (issue 27, item 4) with a stand-in for `vllm.LLM` (sleep
mode needs a GPU): wake(tags=("weights",)) maps only the weights, load_weights may run then,
generate waits for the KV cache; only the tags still asleep reach `LLM.wake_up` (vLLM's executor
ignores a wake naming a tag that is awake); the level-2 check still asks for a load after a wake."""

import pytest
import torch

from verl_hpc.rollout.engine import SLEEP_TAGS, check_tags


class FakeLLM:
    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):  # vLLM 0.32's signature
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method,))
        for _ in kwargs["weights_iterator"]:
            pass

    def reset_prefix_cache(self):
        return True


def _engine(level, calls):
    from verl_hpc.rollout.vllm.engine import VLLMRollout

    eng = VLLMRollout.__new__(VLLMRollout)  # the engine itself needs a GPU for sleep mode
    eng._closed, eng._broken, eng._sleeping, eng._weights_dropped = False, None, set(), False
    eng._sleep_enabled, eng.sleep_level, eng.device, eng._tied = True, level, torch.device("cpu"), False
    eng._weight_names, eng._optional_names, eng._aliases = {"w"}, set(), {}
    eng._drafter = None  # no speculation (rollout/speculative/draft_sync.py)
    eng.llm = FakeLLM(calls)
    return eng


@pytest.mark.parametrize("level", [1, 2])
def test_rol_wake_maps_the_weights_then_the_kv_cache(level):

    calls = []
    eng = _engine(level, calls)
    eng.sleep()
    with pytest.raises(RuntimeError, match="while its weights sleep"):
        eng.load_weights(iter([("w", torch.zeros(1))]))
    eng.wake(tags=("weights",))
    assert calls == [("sleep", level), ("wake_up", ["weights"])] and eng.asleep
    eng.load_weights(iter([("w", torch.zeros(1))]))  # the weights are mapped: the sync may run
    with pytest.raises(RuntimeError, match=r"generate\(\) while asleep \(kv_cache\)"):
        eng._check_usable()
    eng.wake(tags=("kv_cache",))
    assert calls[-1] == ("wake_up", ["kv_cache"]) and not eng.asleep
    eng._check_usable()  # awake with its weights loaded: generate may run
    n = len(calls)
    eng.wake()  # everything is awake: nothing reaches vLLM
    eng.wake(tags=("weights",))
    assert len(calls) == n


def test_rol_wake_passes_only_the_tags_still_asleep():
    calls = []
    eng = _engine(2, calls)
    eng.sleep()
    eng.sleep()  # asleep already: one call
    eng.wake(tags=("weights",))
    eng.wake()  # None: what is still asleep, named (vLLM's wake_up(None) would map the weights twice)
    assert calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    with pytest.raises(RuntimeError, match="sleep level 2 dropped the weights"):
        eng._check_usable()  # woken, but level 2 dropped the weights: a load must come first


def test_rol_wake_tags_are_checked_and_a_noop_without_sleep_mode():
    assert check_tags(None) == SLEEP_TAGS == ("weights", "kv_cache")
    assert check_tags("weights") == ("weights",)
    with pytest.raises(ValueError, match="unknown \\['scheduling'\\]; valid: weights, kv_cache"):
        check_tags(["scheduling"])
    calls = []
    eng = _engine(2, calls)
    eng._sleep_enabled, eng._sleep_requested, eng.name = False, False, "vllm"
    eng.sleep(), eng.wake(tags=("weights",)), eng.wake()
    assert calls == [] and not eng.asleep and not eng.weights_dropped


class FakeCore:
    def __init__(self, calls):
        self.calls = calls

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.mark.parametrize("woken", [(), ("weights",)])
def test_rol_closing_an_asleep_engine_maps_what_sleeps_before_the_shutdown(woken):
    """vLLM's cumem allocator frees a sleeping allocation by unmapping its memory again on CUDA
    (ROCm's path alone skips it): the engine is woken first, so that its shutdown frees mapped
    memory; an awake engine closes as before."""
    calls = []
    eng = _engine(2, calls)
    eng._closed, eng.llm.llm_engine = False, type("E", (), {"engine_core": FakeCore(calls)})()
    eng.sleep()
    for tag in woken:
        eng.wake(tags=(tag,))
    del calls[:]
    eng.close()
    asleep = sorted(set(SLEEP_TAGS) - set(woken))
    assert calls == [("wake_up", asleep), ("shutdown",)] and not eng.asleep
    awake_calls = []
    awake = _engine(2, awake_calls)
    awake.llm.llm_engine = type("E", (), {"engine_core": FakeCore(awake_calls)})()
    awake.close()
    assert awake_calls == [("shutdown",)]
