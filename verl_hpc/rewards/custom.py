"""User reward functions named 'package.module:function', behind safety.allow_custom_code.

Importing a user module runs its code inside every rank of a (possibly very large) job, so it is
an explicit opt-in, checked here as well as in config validation: the check must hold for code
paths that build a RewardScorer without a validated config.

Signature: fn(data_source, solution_str, ground_truth, extra) -> float | dict(score=float, ...).
A custom function replaces the built-in routing for every sample; it receives data_source and can
delegate to `verl_hpc.rewards.default_score` (same signature) for sources it does not handle.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

from verl_hpc.rewards.errors import RewardError

CustomFn = Callable[..., object]


def load_custom_function(spec: str, allow_custom_code: bool) -> CustomFn:
    if not allow_custom_code:
        raise RewardError(f"reward.custom_function = {spec!r} runs your own code: set "
                          "safety.allow_custom_code=true to allow it")
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise RewardError(f"reward.custom_function = {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward.custom_function = {spec!r}: cannot import module {module_name!r} ({e}); "
                          "is it on PYTHONPATH on every node?") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardError(f"reward.custom_function = {spec!r}: module {module_name!r} has no function "
                          f"{fn_name!r}; callables there: {', '.join(public) or 'none'}")
    _check_signature(spec, fn)
    return fn


def _check_signature(spec: str, fn: CustomFn) -> None:
    """Refuse at start-up a function that could never be called with the four arguments."""
    try:
        inspect.signature(fn).bind("ds", "solution", "truth", {})
    except TypeError as e:
        raise RewardError(f"reward.custom_function = {spec!r}: cannot be called as "
                          f"fn(data_source, solution_str, ground_truth, extra) ({e})") from e
    except ValueError:  # builtins without a signature: let the first call decide
        pass
