"""Console backend: a compact table of key metrics every `log_every` steps, plus progress.

Only a handful of metrics fit a terminal line, so they are chosen by name or prefix (a pattern
ending in '/') in a fixed order: reward first, losses next, cost last; everything else goes to
the files. The table is a rich
Table on a terminal and fixed-width text in a Slurm log, so successive steps line up under
each other and `grep`/`awk` still work.
"""
from __future__ import annotations

import math
import sys
from typing import Mapping, Sequence, TextIO

from verl_hpc.tracking.progress import RichBar, StepRate
from verl_hpc.tracking.values import select

# names the trainers emit (verl_hpc/trainer: rl.py's step, sft.py); tracking.console_metrics adds more
KEY_PREFIXES: tuple[str, ...] = (
    "reward/score/mean", "val/", "actor/pg_loss", "actor/kl", "reward/kl", "actor/entropy",
    "actor/grad_norm", "critic/vf_loss", "response_length/mean", "sft/", "perf/tokens_per_s",
    "timing_s/step",
)
MAX_CELLS = 12
CELLS_PER_ROW = 3
NAME_WIDTH = 26
VALUE_WIDTH = 10


def format_value(v: float) -> str:
    if not math.isfinite(v):
        return str(v)  # nan, inf, -inf: shown, never hidden
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{v:,.0f}"
    if a < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _cells(metrics: Mapping[str, float], prefixes: Sequence[str]) -> list[tuple[str, str]]:
    names = select(metrics, prefixes)[:MAX_CELLS]
    return [(n, format_value(metrics[n])) for n in names]


def text_table(cells: list[tuple[str, str]]) -> list[str]:
    """Fixed-width rows of `name value` cells; the widths never depend on the step's content."""
    rows = []
    for i in range(0, len(cells), CELLS_PER_ROW):
        row = cells[i:i + CELLS_PER_ROW]
        rows.append("  " + "   ".join(f"{n:<{NAME_WIDTH}} {v:>{VALUE_WIDTH}}" for n, v in row))
    return rows


class ConsoleBackend:
    def __init__(self, total_steps: int, log_every: int = 1, *, stream: TextIO | None = None,
                 tty: bool | None = None, prefixes: Sequence[str] = KEY_PREFIXES,
                 extra: Sequence[str] = ()) -> None:
        self._stream = stream  # None: sys.stdout at each write (pytest's capsys swaps it)
        self.log_every = max(int(log_every), 1)
        self.total = int(total_steps)
        self.prefixes = tuple(prefixes) + tuple(extra)  # extra (tracking.console_metrics) last
        self.rate = StepRate(total_steps)
        if tty is None:
            tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: RichBar | None = None
        if tty:
            try:
                self._bar = RichBar(self.rate, self.stream)
            except ImportError:  # rich is a core dependency, but a bare env still gets the text
                self._bar = None
        self._last_printed: int | None = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _due(self, step: int, metrics: Mapping[str, float]) -> bool:
        """Every log_every steps, the first and last step, and any step carrying validation."""
        return (self._last_printed is None or step % self.log_every == 0 or step >= self.total
                or any(k.startswith("val/") for k in metrics))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.rate.update(step, metrics.get("timing_s/step"))  # validation left out (progress.py)
        if self._bar is not None:
            self._bar.update()
        if not self._due(step, metrics):
            return
        self._last_printed = step
        cells = _cells(metrics, self.prefixes)
        if self._bar is not None:
            self._bar.console.print(self._rich_table(step, cells) if cells
                                    else f"step {step}/{self.total}")
        else:
            print(self.rate.line(), file=self.stream)
            for row in text_table(cells):
                print(row, file=self.stream)
            self.stream.flush()

    def _rich_table(self, step: int, cells: list[tuple[str, str]]):
        from rich import box
        from rich.table import Table

        # as many cells per row as the terminal fits: a value cut to "12,3…" would be worse than
        # a taller table
        per_row = max(1, min(CELLS_PER_ROW, self._bar.console.width // (NAME_WIDTH + VALUE_WIDTH + 4),
                             len(cells)))
        table = Table(title=f"step {step}/{self.total}", title_justify="left", box=box.SIMPLE,
                      show_header=False, pad_edge=False)
        for _ in range(per_row):
            table.add_column(style="cyan", overflow="fold")
            table.add_column(justify="right", no_wrap=True, min_width=len(max(
                (v for _, v in cells), key=len)))
        for i in range(0, len(cells), per_row):
            row = cells[i:i + per_row]
            row = row + [("", "")] * (per_row - len(row))
            table.add_row(*[x for cell in row for x in cell])
        return table

    def note(self, text: str) -> None:
        """A one-off line (where the plots went); above the bar when there is one."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
