"""Metric values: coerce to float without crashing, name the non-finite ones, flatten configs.

Training code hands us Python floats, ints, 0-d tensors and numpy scalars. Every backend wants a
plain float, and a value that cannot become one (a string, a 2-element tensor) must not end a long
run: it is dropped with one warning per name.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

# Keys the JSONL line uses for itself; a metric with one of these names would be overwritten.
RESERVED = frozenset({"step", "time", "nonfinite"})


def to_float(value: Any) -> float | None:
    """float(value) for numbers, 1-element tensors and numpy scalars; None when it is not one."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)  # torch / numpy scalars, without importing either
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError):  # more than one element
            return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class MetricCleaner:
    """Turns an incoming metrics dict into {name: float}, warning once per bad name."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        clean: dict[str, float] = {}
        for name, value in metrics.items():
            name = str(name)
            if name in RESERVED:
                self._warn_once(name, f"metric name {name!r} is reserved by the metrics file; "
                                      "rename it (e.g. 'timing_s/step'); value dropped")
                continue
            number = to_float(value)
            if number is None:
                self._warn_once(name, f"metric {name!r} is not a number "
                                      f"({type(value).__name__}); value dropped")
                continue
            clean[name] = number
        return clean

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("tracking: %s", message)


def nonfinite_names(metrics: Mapping[str, float]) -> list[str]:
    return sorted(k for k, v in metrics.items() if not math.isfinite(v))


def json_safe(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """NaN and +-inf are not JSON; they become null (the line's `nonfinite` list says which)."""
    return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


def flatten_config(config: Mapping[str, Any] | None, sep: str = ".") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: W&B takes nesting, MLflow params and TB text want it flat."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                walk(f"{prefix}{sep}{key}" if prefix else str(key), child)
        else:
            out[prefix] = node

    walk("", config or {})
    return out


def select(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """Names matching any pattern, grouped in pattern order (the order a reader expects).

    A pattern ending in '/' is a prefix (`val/` takes every validation metric); any other pattern
    is an exact name, so `perf/tokens_per_s` does not also drag in `perf/tokens_per_s_per_gpu`.
    """
    names = list(names)
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if (n.startswith(pattern) if pattern.endswith("/") else n == pattern)]
        chosen.extend(n for n in hits if n not in chosen)
    return chosen
