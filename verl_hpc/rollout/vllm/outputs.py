"""vLLM's request outputs as the rollout's rows (one replica's shard): each prompt's samples in their
order, the sampled tokens' log-probs, the finish reason, the LoRA adapter vLLM itself says it used,
and the speculation counts where the engine speculates."""
from __future__ import annotations

from typing import List

from verl_hpc.rollout.result import FINISH_REASONS, ShardOutput


def shard_rows(outputs, first_index: int, spec_counter=None) -> ShardOutput:
    """Rows in prompt order, n per prompt, from `LLM.generate`'s outputs for prompts first_index, ..."""
    rows = ShardOutput.empty()
    for k, out in enumerate(outputs):
        # the adapter vLLM itself says it used (its request's id is version + 1: ids must be > 0)
        used = out.lora_request.lora_int_id - 1 if out.lora_request is not None else -1
        for seq in sorted(out.outputs, key=lambda c: c.index):
            ids = list(seq.token_ids)
            if seq.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"vllm rollout: prompt {first_index + k} ended with "
                                   f"finish_reason={seq.finish_reason!r}")
            rows.prompt_index.append(first_index + k)
            rows.sample_index.append(seq.index)
            rows.response_ids.append(ids)
            rows.logprobs.append(sampled_logprobs(seq.logprobs, ids))
            rows.finish_reason.append(seq.finish_reason)
            rows.adapter_version.append(used)
            if spec_counter is not None:
                spec_counter.add(seq)
    return rows


def sampled_logprobs(logprobs, token_ids: List[int]) -> List[float]:
    """Per-token logprobs of the sampled tokens from vLLM's (flat) logprobs."""
    if logprobs is None:
        raise RuntimeError("vllm rollout: no logprobs returned (SamplingParams.logprobs unset?)")
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and list(flat_ids) == token_ids:  # one entry per position: the sampled
        return [float(x) for x in logprobs.logprobs]
    return [float(logprobs[pos][tok].logprob) for pos, tok in enumerate(token_ids)]
