"""rollout/speculative/stats.py without an engine: vLLM's per-sequence counts (0.32) or its scheduler's
per-step ones (0.25) -> SpecCounts -> the step's rollout/spec_* metrics, against vLLM's own summary of
the same counts; `measured` over fake engines.
(The engine end: test_speculative_vllm.py::test_the_steps_acceptance_metrics.)"""
import dataclasses
from types import SimpleNamespace

import pytest

from verl_hpc.rollout.speculative.stats import SpecCounts, measured


STEPS = ([(4, 4), (4, 0), (4, 2)], [(3, 1)], [])  # per sequence: (proposed, accepted) per verify step
TOTAL = SpecCounts(steps=4, drafted=15, accepted=7)


def test_counts_and_metrics_agree_with_vllms_own_summary():
    """0.32's per-sequence counts (0.25 has none: the next test)."""
    from verl_hpc.rollout.vllm import versions

    if not versions.release().per_request_spec_metrics:
        with pytest.raises(ImportError):
            from vllm.v1.metrics.stats import RequestSpecDecodeMetrics  # noqa: F401
        return
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    seqs = []
    for steps in STEPS:
        m = RequestSpecDecodeMetrics.new(4)
        for drafted, kept in steps:
            m.observe(num_draft_tokens=drafted, num_accepted=kept)
        seqs.append(m)
    total = sum((SpecCounts.of_vllm(m) for m in seqs), SpecCounts()) + SpecCounts.of_vllm(None)
    assert total == TOTAL
    one = seqs[0].to_dict()  # vLLM's per-sequence summary, for the first sequence
    got = SpecCounts.of_vllm(seqs[0]).metrics()
    assert got["rollout/spec_acceptance"] == pytest.approx(one["draft_acceptance_rate"])
    assert got["rollout/spec_accepted_length"] == pytest.approx(one["mean_acceptance_length"])
    assert total.metrics("val/rollout") == {"val/rollout/spec_draft_tokens": 15.0,
                                            "val/rollout/spec_acceptance": 7 / 15,
                                            "val/rollout/spec_accepted_length": 1 + 7 / 4}
    # nothing proposed (a schedule's K = 0 range): no ratio made up
    assert SpecCounts().metrics() == {"rollout/spec_draft_tokens": 0.0}


def test_the_scheduler_counts_agree_with_vllms_own_step_stats():
    """0.25's source of the counts (rollout/vllm/spec_counts.py): vLLM's own scheduler method, wrapped,
    over the same verify steps (one of them with a grammar-invalidated token) as one engine step's
    SpecDecodingStats; with stat logging off the counts are the same and vLLM records nothing."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from verl_hpc.rollout.vllm import versions
    from verl_hpc.rollout.vllm.spec_counts import SpecCounter

    for log_stats in (True, False):
        scheduler = SimpleNamespace(log_stats=log_stats, num_spec_tokens=4)
        counter = SpecCounter(dataclasses.replace(versions.release(), per_request_spec_metrics=False))
        make = counter.counting(Scheduler.make_spec_decoding_stats.__get__(scheduler))
        stats = None
        for seq, steps in enumerate(STEPS):
            for drafted, kept in steps:
                stats = make(stats, drafted, kept, None, f"r{seq}")
        stats = make(stats, 4, 1, {"r9": 1}, "r9")  # 4 proposed, one of them invalidated by a grammar
        assert counter.counts == TOTAL + SpecCounts(1, 3, 1)
        if log_stats:
            assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 18, 8)
        else:
            assert stats is None


class FakeEngine:
    layout = SimpleNamespace(world_size=1)

    def __init__(self):
        self.total = SpecCounts(2, 8, 3)  # counts of earlier calls

    def speculation_counts(self):
        return self.total


def test_measured_sets_the_calls_own_counts():
    engine = FakeEngine()

    def call():
        engine.total = engine.total + SpecCounts(5, 20, 11)
        return SimpleNamespace(speculation=None)

    assert measured(engine, call).speculation == SpecCounts(5, 20, 11)
    # an engine that does not speculate (the HF rollout, a remote handle) leaves it None
    assert measured(object(), lambda: SimpleNamespace(speculation=None)).speculation is None
