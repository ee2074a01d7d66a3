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


class FakeMemory:
    """A memory window like runtime.memory_peaks': `use(n)` allocates to n bytes now."""

    def __init__(self):
        self.now = self.high = 0

    def use(self, n):
        self.now = n
        self.high = max(self.high, n)

    def current(self):
        return self.now

    def peak(self):
        return self.high

    def reset(self):
        self.high = self.now


def test_stage_memory_peaks_and_rises_with_a_nested_stage():
    mem, gib = FakeMemory(), 2**30
    timer = StageTimer(memory=mem)
    mem.use(1 * gib)
    with timer("update_actor"):
        mem.use(5 * gib)               # the outer stage's own peak, before the inner stage resets the window
        mem.use(2 * gib)
        with timer("old_logprob"):
            mem.use(3 * gib)
            mem.use(2 * gib)
        mem.use(1 * gib)
    with timer("generate"):
        mem.use(4 * gib)
        mem.use(1 * gib)
    with timer("generate"):            # a second entry: the step reports the larger of the two
        mem.use(2 * gib)
    m = timer.pop()
    assert {k: v for k, v in m.items() if k.startswith("mem_")} == pytest.approx({
        "mem_peak_gib/update_actor": 5, "mem_rise_gib/update_actor": 4,
        "mem_peak_gib/old_logprob": 3, "mem_rise_gib/old_logprob": 1,
        "mem_peak_gib/generate": 4, "mem_rise_gib/generate": 3})
    with timer("update_actor"):        # the inner stage's peak is the outer's when it is the higher
        with timer("ref"):
            mem.use(6 * gib)
        mem.use(1 * gib)
    m = timer.pop()
    assert m["mem_peak_gib/update_actor"] == 6 and m["mem_peak_gib/ref"] == 6
    assert timer.pop() == {"timing_s/step": pytest.approx(0.0, abs=1)}  # nothing left over


def test_host_probe_sees_a_stage_allocation_and_keeps_the_run_peak():
    """The CPU probe for real: a 256 MiB buffer touched inside a stage shows in its rise, not in the
    next stage's, and the process's run-long peak survives the window resets."""
    import numpy as np

    from verl_hpc.runtime import memory_peaks

    probe = memory_peaks.probe()
    assert isinstance(probe, memory_peaks.HostPeaks), "this Linux lets a process reset its own VmHWM"
    timer, mib = StageTimer(memory=probe), 2**20
    with timer("generate"):
        buf = np.ones(256 * mib, dtype=np.uint8)  # written, so resident
        del buf
    with timer("reward"):
        pass
    m = timer.pop()
    assert 250 / 1024 < m["mem_rise_gib/generate"] < 1.0, m
    assert m["mem_rise_gib/reward"] < 64 / 1024, m
    assert memory_peaks.process_peak_bytes() >= m["mem_peak_gib/generate"] * 2**30
