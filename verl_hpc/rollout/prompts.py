"""Prompts in: checked token ids, and the `rollout.prompt_overflow` policy for long ones.

truncate: keep the LAST data.max_prompt_length tokens (left truncation: the end of a prompt, where
          a chat template puts the question and the assistant header, is what the model must see);
          the number cut is counted in RolloutResult.num_truncated.
reject:   raise PromptTooLongError (a ValueError) naming the first offending prompt, before any
          generation, on every rank alike (every rank holds the same global list).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.errors import VerlHpcError

# the policies fit_prompts implements; engines built without a config (tests, benchmarks) reach it
# with any string, so it names these rather than a copy of the config's list
OVERFLOW_POLICIES = ("truncate", "reject")


class PromptTooLongError(VerlHpcError, ValueError):
    """prompt_overflow=reject and at least one prompt is longer than data.max_prompt_length."""

    exit_code, kind = 17, "prompt too long"

    def __init__(self, too_long: List[Tuple[int, int]], limit: int):
        self.too_long = too_long  # (prompt index, length) of every offending prompt
        self.limit = limit
        index, length = too_long[0]
        super().__init__(
            f"prompt {index} has {length} tokens, more than data.max_prompt_length={limit} "
            f"({len(too_long)} prompt(s) of this batch are too long); rollout.prompt_overflow="
            f"reject refuses them: raise data.max_prompt_length, filter the data set, or set "
            f"rollout.prompt_overflow=truncate (keeps the last {limit} tokens)")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None) -> List[List[int]]:
    """Plain lists of ints, non-empty, inside the vocabulary; errors name the prompt index."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("generate(prompts=...) takes a list of token-id lists, one per prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise TypeError(f"prompt {i} is a string; generate takes token ids (tokenize first)")
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        lo, hi = min(ids), max(ids)
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt {i} holds token id {bad}, outside the model's vocabulary "
                             f"[0, {vocab_size})")
        out.append(ids)
    return out


def fit_prompts(prompts: List[List[int]], max_prompt_length: int,
                policy: str) -> Tuple[List[List[int]], int]:
    """Apply the overflow policy; returns (prompts to generate from, number truncated)."""
    if policy not in OVERFLOW_POLICIES:
        raise ConfigError(f"rollout.prompt_overflow={policy!r} is not one of "
                          f"{', '.join(OVERFLOW_POLICIES)}")
    too_long = [(i, len(p)) for i, p in enumerate(prompts) if len(p) > max_prompt_length]
    if not too_long:
        return prompts, 0
    if policy == "reject":
        raise PromptTooLongError(too_long, max_prompt_length)
    fitted = [p[-max_prompt_length:] if len(p) > max_prompt_length else p for p in prompts]
    return fitted, len(too_long)
