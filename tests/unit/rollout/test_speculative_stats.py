"""rollout/speculative/stats.py without an engine: vLLM's per-sequence counts -> SpecCounts -> the step's
rollout/spec_* metrics, against vLLM's own summary of the same counts; `measured` over fake engines.
(The engine end: test_speculative_vllm.py::test_the_steps_acceptance_metrics.)"""
from types import SimpleNamespace

import pytest

from verl_hpc.rollout.speculative.stats import SpecCounts, measured


def test_counts_and_metrics_agree_with_vllms_own_summary():
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    seqs = []
    for steps in ([(4, 4), (4, 0), (4, 2)], [(3, 1)], []):  # (proposed, accepted) per verify step
        m = RequestSpecDecodeMetrics.new(4)
        for drafted, kept in steps:
            m.observe(num_draft_tokens=drafted, num_accepted=kept)
        seqs.append(m)
    total = sum((SpecCounts.of_vllm(m) for m in seqs), SpecCounts()) + SpecCounts.of_vllm(None)
    assert total == SpecCounts(steps=4, drafted=15, accepted=7)
    one = seqs[0].to_dict()  # vLLM's per-sequence summary, for the first sequence
    got = SpecCounts.of_vllm(seqs[0]).metrics()
    assert got["rollout/spec_acceptance"] == pytest.approx(one["draft_acceptance_rate"])
    assert got["rollout/spec_accepted_length"] == pytest.approx(one["mean_acceptance_length"])
    assert total.metrics("val/rollout") == {"val/rollout/spec_draft_tokens": 15.0,
                                            "val/rollout/spec_acceptance": 7 / 15,
                                            "val/rollout/spec_accepted_length": 1 + 7 / 4}
    # nothing proposed (a schedule's K = 0 range): no ratio made up
    assert SpecCounts().metrics() == {"rollout/spec_draft_tokens": 0.0}


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
