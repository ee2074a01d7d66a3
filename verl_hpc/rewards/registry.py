"""Routing a sample to its rule-based scorer by `data_source`.

A data_source routes to a scorer when, lower-cased, it or its last '/'-component is a registered
name or alias, or starts with one followed by a separator: `openai/gsm8k`, `GSM8K`, `gsm8k-test`
-> gsm8k; `lighteval/MATH`, `MATH-500`, `DigitalLearningGmbH/MATH-lighteval` -> math. The separator
rule keeps `mathematics` from matching `math`. An exact name always wins over a prefix
(`gsm8k_flexible` is its own scorer, not gsm8k).

Each scorer may also check ground truths up front (`check`), so a non-numeric gsm8k answer stops
the run when the data is loaded instead of scoring 0 for every rollout of that prompt.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence

from verl_hpc.rewards import basic, gsm8k, math_answer
from verl_hpc.rewards.errors import RewardError

ScoreFn = Callable[[str, str, Any], float]  # (solution_str, ground_truth, extra) -> score
CheckFn = Callable[[str], Optional[str]]  # ground_truth -> problem or None


@dataclass(frozen=True)
class RuleScorer:
    name: str
    fn: ScoreFn
    check: Optional[CheckFn] = None


_SCORERS: Dict[str, RuleScorer] = {}
_ALIASES: Dict[str, str] = {}  # lower-case alias -> registered name


def register(name: str, fn: ScoreFn, aliases: Sequence[str] = (), check: Optional[CheckFn] = None) -> None:
    _SCORERS[name] = RuleScorer(name, fn, check)
    for alias in (name, *aliases):
        _ALIASES[alias.lower()] = name


def known_names() -> List[str]:
    return sorted(_SCORERS)


def resolve(data_source: str) -> Optional[RuleScorer]:
    """The scorer for a data_source, or None when no rule applies."""
    lowered = data_source.strip().lower()
    candidates = [lowered, lowered.rsplit("/", 1)[-1]]
    for c in candidates:
        if c in _ALIASES:
            return _SCORERS[_ALIASES[c]]
    for c in candidates:  # longest alias first: 'gsm8k_flexible-x' is gsm8k_flexible, not gsm8k
        for alias in sorted(_ALIASES, key=len, reverse=True):
            if c.startswith(alias) and re.match(r"[^a-z0-9]", c[len(alias):]):
                return _SCORERS[_ALIASES[alias]]
    return None


def unknown_source_message(data_source: str) -> str:
    hint = difflib.get_close_matches(data_source.lower(), list(_ALIASES), n=1)
    tail = f" (did you mean {hint[0]!r}?)" if hint else ""
    return (f"no reward function for data_source {data_source!r}{tail}; known: {', '.join(known_names())} "
            "(also as a prefix, e.g. 'openai/gsm8k', 'MATH-500'); to score other sources set "
            "reward.custom_function with safety.allow_custom_code=true, or enable reward.reward_model")


def get_scorer(data_source: str) -> RuleScorer:
    scorer = resolve(data_source)
    if scorer is None:
        raise RewardError(unknown_source_message(data_source))
    return scorer


def default_score(data_source: str, solution_str: str, ground_truth: str, extra: Any = None) -> float:
    """The built-in rules, with the custom-function signature: a custom function can delegate here."""
    return get_scorer(data_source).fn(solution_str, ground_truth, extra)


register("gsm8k", partial(gsm8k.gsm8k_score, method="strict"), aliases=("gsm8k_strict",),
         check=gsm8k.check_ground_truth)
register("gsm8k_flexible", partial(gsm8k.gsm8k_score, method="flexible"), check=gsm8k.check_ground_truth)
register("math", math_answer.math_score, aliases=("competition_math", "hendrycks_math", "math500"),
         check=math_answer.check_ground_truth)
register("synthetic_arith", basic.synthetic_arith_score, check=basic.check_integer_ground_truth)
# the tool demo (verl_hpc/data/prepare/tool_arith.py): the episode's answer, scored as synthetic_arith
register("tool_arith", basic.synthetic_arith_score, check=basic.check_integer_ground_truth)
# the VLM demo (verl_hpc/data/prepare/visual.py): data sources visual_count, visual_colour, visual_bar
# route here by prefix, and validation reports each kind's accuracy under its own source
register("visual", basic.first_word_score, check=basic.check_word_ground_truth)
register("exact_match", basic.exact_match_score, check=basic.check_nonempty_ground_truth)
