"""The prompt length filter: prompts over data.max_prompt_length tokens are dropped or refused.

Filtering happens once, when a dataset is loaded and before any step runs, so that a too-long
prompt stops a run (overlong_prompts: error) before it has spent compute, and a dropped prompt
never reaches the rollout engine, whose own overflow handling (rollout.prompt_overflow) would
otherwise truncate it silently.
"""
from __future__ import annotations

import logging
from typing import List, Sequence, Tuple

from verl_hpc.data.errors import DataError

log = logging.getLogger(__name__)
# the modes filter_overlong implements; PromptDataset.load is also called without a config (tests,
# tools), so it names these rather than a copy of the config's list
OVERLONG_MODES = ("drop", "error")


def filter_overlong(ids: Sequence[str], lengths: Sequence[int], max_prompt_length: int,
                    mode: str = "drop", what: str = "data.train_files",
                    log_drops: bool = True) -> Tuple[List[int], int]:
    """(indices of the prompts kept, number dropped). mode 'error' raises naming the rows instead;
    either mode raises when every prompt is too long. log_drops=False: the caller reports the count."""
    if mode not in OVERLONG_MODES:
        raise DataError(f"data.overlong_prompts: invalid value {mode!r}; valid: {', '.join(OVERLONG_MODES)}")
    kept = [i for i, n in enumerate(lengths) if n <= max_prompt_length]
    dropped = len(lengths) - len(kept)
    if lengths and not kept:  # whichever mode: nothing would be left to train on
        raise DataError(f"{what}: all {len(lengths)} prompts are longer than data.max_prompt_length = "
                        f"{max_prompt_length} tokens; nothing is left to train on")
    if dropped and mode == "error":
        over = [i for i, n in enumerate(lengths) if n > max_prompt_length]
        problems = [f"{what} sample {ids[i]}: prompt is {lengths[i]} tokens, over data.max_prompt_length = "
                    f"{max_prompt_length}; raise data.max_prompt_length, shorten the prompt, or set "
                    "data.overlong_prompts=drop" for i in over]
        raise DataError.from_problems(problems)
    if dropped and log_drops:
        longest = max(lengths)
        log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length = %d tokens (longest: %d)",
                    what, dropped, len(lengths), max_prompt_length, longest)
    return kept, dropped
