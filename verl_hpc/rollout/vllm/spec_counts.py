"""Speculative decoding's acceptance counts out of vLLM, for rollout/speculative/stats.py (the
trainer's rollout/spec_* metrics), in each verified release (rollout/vllm/versions.py):

- 0.32 returns them with every finished sequence (`per_request_spec_decode_metrics="summary"`: its
  RequestSpecDecodeMetrics), added up as the rows come back;
- 0.25 has no per-sequence counts. Its scheduler sees every verify step of every sequence
  (`Scheduler.make_spec_decoding_stats`, called with the step's proposed and accepted tokens even
  with stat logging off, which then returns without recording), so this engine's scheduler has that
  method wrapped: each call with a proposal is one step, as 0.32's per-sequence histogram counts it.
  No stat logger and no Prometheus registry either way.

Both give the same cumulative SpecCounts (tests/unit/rollout/test_speculative_stats.py).
"""
from __future__ import annotations

from verl_hpc.rollout.speculative.stats import SpecCounts
from verl_hpc.rollout.vllm import versions


class SpecCounter:
    """One speculating engine's cumulative counts (`counts`)."""

    def __init__(self, release: versions.Release):
        self.per_request = release.per_request_spec_metrics
        self.counts = SpecCounts()

    def engine_args(self) -> dict:
        """What `vllm.LLM(...)` must be given for the counts."""
        return {"per_request_spec_decode_metrics": "summary"} if self.per_request else {}

    def attach(self, llm) -> None:
        """After the engine is built: 0.25's scheduler reports each verify step here."""
        if self.per_request:
            return
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        scheduler.make_spec_decoding_stats = self.counting(scheduler.make_spec_decoding_stats)

    def counting(self, upstream):
        def make_spec_decoding_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                     num_invalid_spec_tokens, request_id):
            if num_draft_tokens:
                invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)  # upstream's own adjustment
                self.counts += SpecCounts(1, num_draft_tokens - invalid, num_accepted_tokens)
            return upstream(spec_decoding_stats, num_draft_tokens=num_draft_tokens,
                            num_accepted_tokens=num_accepted_tokens,
                            num_invalid_spec_tokens=num_invalid_spec_tokens, request_id=request_id)
        make_spec_decoding_stats.__wrapped__ = upstream
        return make_spec_decoding_stats

    def add(self, seq) -> None:
        """A finished sequence (0.32: its own counts)."""
        if self.per_request:
            self.counts += SpecCounts.of_vllm(seq.spec_decode_metrics)
