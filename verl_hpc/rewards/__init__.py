"""Rewards: rule-based scorers routed by data_source, custom functions, a reward-model hook.

    scorer = RewardScorer.from_config(cfg.reward, allow_custom_code=cfg.safety.allow_custom_code)
    scores, metrics = scorer.score(ids, data_sources, response_texts, ground_truths, extras)
    token_level = scorer.to_token_level(scores, response_mask)

Names are imported on first use: the answer extractors (gsm8k, math_answer) are plain Python and
the data preprocessors use them, which should not cost a torch import (~2 s per CLI call).
"""
import importlib

_EXPORTS = {
    "RewardError": "errors", "RewardScorer": "scorer", "RewardModel": "reward_model", "combine": "reward_model",
    "default_score": "registry", "get_scorer": "registry", "known_names": "registry", "register": "registry",
    "resolve": "registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"verl_hpc.rewards.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'verl_hpc.rewards' has no attribute {name!r}")
