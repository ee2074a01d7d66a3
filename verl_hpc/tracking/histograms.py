"""Histograms carried as plain scalar metrics: `<prefix>/hist/<int>` is the count in integer
bucket <int> of the histogram `<prefix>/hist`.

    metrics |= histogram_metrics("async/staleness", {0: 812, 1: 40, 2: 3})
    # {"async/staleness/hist/0": 812.0, "async/staleness/hist/1": 40.0, "async/staleness/hist/2": 3.0}

Why scalars: a step's metrics stay {name: float}, which the JSONL file, MLflow, the plot and the
metric history a checkpoint carries already take as they are. The backends that have a histogram
type (TensorBoard, W&B, Prometheus) gather one prefix's keys back into one histogram
(`split_histograms`). A bucket not logged at a step counts 0, so a producer may leave empty
buckets out; the buckets between the lowest and the highest logged one are all there, since
TensorBoard and W&B draw contiguous bins. A non-finite count (the JSONL file still records it)
is left out of the histogram rather than poisoning its sums.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

HIST = "/hist/"
_KEY = re.compile(r"^(?P<prefix>.+)/hist/(?P<bucket>-?\d+)$")


@dataclass(frozen=True)
class Histogram:
    prefix: str
    low: int                   # the first bucket
    counts: tuple[float, ...]  # buckets low, low + 1, ...: every one, 0 where nothing was logged

    @property
    def name(self) -> str:
        return self.prefix + "/hist"

    @property
    def buckets(self) -> range:
        return range(self.low, self.low + len(self.counts))

    @property
    def total(self) -> float:
        return sum(self.counts)

    @property
    def sum(self) -> float:
        return sum(b * c for b, c in zip(self.buckets, self.counts))

    @property
    def sum_squares(self) -> float:
        return sum(b * b * c for b, c in zip(self.buckets, self.counts))

    @property
    def mean(self) -> float:
        return self.sum / self.total if self.total else math.nan

    def filled(self) -> list[int]:
        """The buckets with a nonzero count, lowest first."""
        return [b for b, c in zip(self.buckets, self.counts) if c]

    def edges(self) -> list[float]:
        """Bin edges halfway between integers (numpy's convention: one more than the buckets)."""
        return [b - 0.5 for b in self.buckets] + [self.low + len(self.counts) - 0.5]


def hist_key(prefix: str, bucket: int) -> str:
    return f"{prefix}{HIST}{int(bucket)}"


def histogram_metrics(prefix: str, counts: Mapping[int, float]) -> dict[str, float]:
    """The scalar keys a producer logs for one histogram: {bucket: count} -> {key: count}."""
    return {hist_key(prefix, b): float(c) for b, c in sorted(counts.items())}


def is_hist_key(name: str) -> bool:
    return HIST in name and _KEY.match(name) is not None


def split_histograms(metrics: Mapping[str, float]) -> tuple[dict[str, float], list[Histogram]]:
    """(the metrics that are not histogram buckets, one Histogram per prefix in first-seen order)."""
    scalars: dict[str, float] = {}
    found: dict[str, dict[int, float]] = {}
    for name, value in metrics.items():
        m = _KEY.match(name) if HIST in name else None
        if m is None:
            scalars[name] = value
        elif math.isfinite(value):
            found.setdefault(m["prefix"], {})[int(m["bucket"])] = value
        else:
            found.setdefault(m["prefix"], {})
    return scalars, [_histogram(prefix, counts) for prefix, counts in found.items() if counts]


def _histogram(prefix: str, counts: Mapping[int, float]) -> Histogram:
    low, high = min(counts), max(counts)
    return Histogram(prefix, low, tuple(float(counts.get(b, 0.0)) for b in range(low, high + 1)))
