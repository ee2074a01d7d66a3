"""StageTimer sums per stage per step; throughput from counts and the step time."""
import pytest

from verl_hpc.tracking import STAGES, StageTimer, throughput


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def test_stage_seconds_sum_within_a_step_and_reset_on_pop():
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with timer("generate"):
        clock.advance(2.0)
    with timer("reward"):
        clock.advance(0.25)
    with timer("generate"):          # a second generate in the same step adds up
        clock.advance(1.0)
    clock.advance(0.5)               # untimed work (data loading) shows in step only
    m = timer.pop()
    assert m == pytest.approx({"timing_s/generate": 3.0, "timing_s/reward": 0.25,
                               "timing_s/step": 3.75})
    with timer.stage("update_actor"):
        clock.advance(4.0)
    m = timer.pop()
    assert m == pytest.approx({"timing_s/update_actor": 4.0, "timing_s/step": 4.0})
    assert timer.pop() == {"timing_s/step": 0.0}


def test_stage_time_recorded_when_block_raises_and_sync_called_at_edges():
    clock, calls = FakeClock(), []
    timer = StageTimer(clock=clock, sync=lambda: calls.append(clock()))
    with pytest.raises(RuntimeError):
        with timer("sync"):
            clock.advance(1.5)
            raise RuntimeError("boom")
    assert timer.seconds("sync") == pytest.approx(1.5)
    assert calls == [100.0, 101.5]  # device synchronize before and after the block


def test_all_design_stages_named_and_real_clock_works():
    assert STAGES == ("wake", "sync", "wake_kv", "generate", "reward", "old_logprob", "ref", "prm", "update_prm",
                      "values", "adv", "update_critic", "update_actor")
    timer = StageTimer(prefix="t")
    for name in STAGES:
        with timer(name):
            pass
    m = timer.pop()
    assert set(m) == {f"t/{s}" for s in STAGES} | {"t/step"}
    assert m["t/step"] >= sum(m[f"t/{s}"] for s in STAGES) >= 0


def test_throughput():
    m = throughput(2.0, tokens=1000, samples=8, world_size=4)
    assert m == pytest.approx({"perf/tokens_per_s": 500.0, "perf/tokens_per_s_per_gpu": 125.0,
                               "perf/samples_per_s": 4.0})
    assert throughput(2.0, samples=8) == {"perf/samples_per_s": 4.0}
    assert throughput(0.0, tokens=10) == {}
