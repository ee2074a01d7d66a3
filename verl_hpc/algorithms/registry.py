"""Name -> function registries, so that an algorithm is chosen by a config string.

Each registry knows which config field selects from it, so an unknown name produces an error that
says which field is wrong and what would be valid (house rule: no bare KeyError for a bad config).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Tuple

from verl_hpc.config.errors import ConfigError


class Registry:
    """A small name -> callable table filled by a decorator.

    `call` lets the trainer hand every input it has (values, group ids, baselines, clip ranges, ...)
    to whichever function the config picked: each function receives only the keyword arguments it
    declares. A keyword that *no* registered function declares is rejected, so a misspelt option
    fails loudly instead of being silently dropped.
    """

    def __init__(self, kind: str, field: str):
        self.kind = kind  # e.g. "advantage estimator", used in error messages
        self.field = field  # e.g. "algorithm.adv_estimator", the config field that selects
        self._fns: Dict[str, Callable] = {}

    def register(self, *names: str) -> Callable[[Callable], Callable]:
        """Decorator: register a function under one or more names (aliases share one function)."""

        def deco(fn: Callable) -> Callable:
            for name in names:
                if name in self._fns:
                    raise ValueError(f"{self.kind} {name!r} is registered twice")
                self._fns[name] = fn
            return fn

        return deco

    def names(self) -> Tuple[str, ...]:
        return tuple(self._fns)

    def get(self, name: str) -> Callable:
        if name not in self._fns:
            valid = ", ".join(self._fns)
            raise ConfigError(f"unknown {self.kind} {name!r} in {self.field}; valid names: {valid}")
        return self._fns[name]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = self.get(name)
        known = set()
        for other in self._fns.values():
            known.update(inspect.signature(other).parameters)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown keyword(s) {unknown} for a {self.kind}; accepted: {sorted(known)}"
            )
        params = inspect.signature(fn).parameters
        accepted = {k: v for k, v in kwargs.items() if k in params}
        positional = list(params)[: len(args)]
        missing = [
            p.name
            for p in params.values()
            if p.default is inspect.Parameter.empty
            and p.kind is not inspect.Parameter.VAR_KEYWORD
            and p.kind is not inspect.Parameter.VAR_POSITIONAL
            and p.name not in accepted
            and p.name not in positional
        ]
        if missing:
            raise ValueError(f"{self.kind} {name!r} ({self.field}) needs input(s) {missing}")
        return fn(*args, **accepted)


ADV_ESTIMATOR_REGISTRY = Registry("advantage estimator", "algorithm.adv_estimator")
POLICY_LOSS_REGISTRY = Registry("policy loss", "actor.policy_loss")
KL_ESTIMATOR_REGISTRY = Registry("KL estimator", "algorithm.kl_penalty / actor.kl_loss_type")


def register_adv_estimator(*names: str) -> Callable[[Callable], Callable]:
    return ADV_ESTIMATOR_REGISTRY.register(*names)


def get_adv_estimator(name: str) -> Callable:
    return ADV_ESTIMATOR_REGISTRY.get(name)


def register_policy_loss(*names: str) -> Callable[[Callable], Callable]:
    return POLICY_LOSS_REGISTRY.register(*names)


def get_policy_loss(name: str) -> Callable:
    return POLICY_LOSS_REGISTRY.get(name)


def register_kl_estimator(*names: str) -> Callable[[Callable], Callable]:
    return KL_ESTIMATOR_REGISTRY.register(*names)


def get_kl_estimator(name: str) -> Callable:
    return KL_ESTIMATOR_REGISTRY.get(name)
