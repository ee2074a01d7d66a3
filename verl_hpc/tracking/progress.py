"""Progress over training steps: a rich bar on a terminal, a plain line in a Slurm log.

A bar redraws itself with carriage returns and ANSI codes; in a file (Slurm's stdout) that becomes
megabytes of garbage, so off a TTY we print `step 12/200 (6%) 3.4 s/step ETA 10m38s` whenever the
console backend prints its table instead.

The rate is taken over a window of recent steps, not since the start: the first step carries
one-off costs (compilation, cache warm-up, the first weight sync) that would otherwise inflate
the ETA for the whole run. Where the trainer reports its step time (`timing_s/step`, which leaves
validation out), the rate is the mean of those, so a validation every k steps does not make the
ETA of the training steps longer (the wall time between log() calls would include it).
"""
from __future__ import annotations

import collections
import math
import time
from typing import Callable, TextIO

WINDOW = 20  # steps the rate is averaged over


def format_duration(seconds: float) -> str:
    """38s, 10m38s, 2h05m, 3d04h: two units are enough for an ETA."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_rate(seconds_per_step: float) -> str:
    if not math.isfinite(seconds_per_step):
        return "? s/step"
    if seconds_per_step >= 10:
        return f"{seconds_per_step:.0f} s/step"
    if seconds_per_step >= 0.1:
        return f"{seconds_per_step:.1f} s/step"
    return f"{seconds_per_step:.3f} s/step"


class StepRate:
    """Seconds per step from the times log() was called; before the second step, since start."""

    def __init__(self, total_steps: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = int(total_steps)
        self._clock = clock
        self._t0 = clock()
        self._seen: collections.deque[tuple[int, float]] = collections.deque(maxlen=WINDOW + 1)
        self._reported: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._first_dropped = False

    def update(self, step: int, seconds: float | None = None) -> None:
        """`seconds`: the step's own duration as the trainer measured it (timing_s/step)."""
        if self._seen and step <= self._seen[-1][0]:
            return  # a second log() for the same step (e.g. validation) is not progress
        self._seen.append((int(step), self._clock()))
        if seconds is not None and math.isfinite(seconds) and seconds >= 0:
            if len(self._reported) == 1 and not self._first_dropped:
                self._reported.popleft()  # the first step's warm-up, once a second step exists
                self._first_dropped = True
            self._reported.append(float(seconds))

    @property
    def step(self) -> int:
        return self._seen[-1][0] if self._seen else 0

    def seconds_per_step(self) -> float:
        if self._reported:
            return sum(self._reported) / len(self._reported)
        if not self._seen:
            return math.nan
        if len(self._seen) == 1:
            return self._seen[0][1] - self._t0
        (s0, t0), (s1, t1) = self._seen[0], self._seen[-1]
        return (t1 - t0) / (s1 - s0)

    def eta_seconds(self) -> float:
        return self.seconds_per_step() * max(self.total - self.step, 0)

    def line(self) -> str:
        pct = 100.0 * self.step / self.total if self.total > 0 else 0.0
        return (f"step {self.step}/{self.total} ({pct:.0f}%) {format_rate(self.seconds_per_step())} "
                f"ETA {format_duration(self.eta_seconds())}")


class RichBar:
    """rich's live bar; tables printed through `.console` appear above it instead of tearing it."""

    def __init__(self, rate: StepRate, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.console = Console(file=stream, force_terminal=True)
        self._rate = rate
        self._progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.percentage:>3.0f}% {task.fields[rate]} ETA {task.fields[eta]}"),
            console=self.console, transient=False)  # stdout prints from the trainer go above it
        self._task = self._progress.add_task("train", total=max(rate.total, 1), rate="", eta="?")
        self._progress.start()

    def update(self) -> None:
        self._progress.update(self._task, completed=self._rate.step,
                              rate=format_rate(self._rate.seconds_per_step()),
                              eta=format_duration(self._rate.eta_seconds()),
                              refresh=True)  # else a table printed now sits above a stale bar

    def stop(self) -> None:
        self._progress.stop()
