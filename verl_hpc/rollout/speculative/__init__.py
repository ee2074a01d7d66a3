"""Speculative decoding in the rollout (`rollout.speculative`; docs/speculative.md), in one place.

- config.py       the section -> vLLM's `speculative_config`, and the rule behind `auto`
- stats.py        acceptance per rollout, for the step's metrics
- draft_sync.py   self-speculation's drafter (the policy's first layers) written and kept in step
                  by the weight sync
- drafter.py      the one loader into vLLM's drafter, and the MTP drafter's tensor names

vLLM verifies every proposed token with its rejection sampler, so responses stay samples of the
policy; the CPU workaround for that sampler lives with the vLLM engine (rollout/vllm/cpu_spec.py).
"""
