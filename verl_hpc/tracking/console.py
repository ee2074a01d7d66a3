"""Console backend: a compact table of key metrics every `log_every` steps, plus progress.

Only a handful of metrics fit a terminal line, so they are chosen by name or prefix (a pattern
ending in '/') in a fixed order: reward first, losses next, cost last; everything else goes to
the files. A chosen histogram (`<prefix>/hist/<int>` keys, histograms.py) is one summary line
under the table, not a cell per bucket. The table is a rich
Table on a terminal and fixed-width text in a Slurm log, so successive steps line up under
each other and `grep`/`awk` still work.
"""
from __future__ import annotations

import math
import sys
from typing import Mapping, Sequence, TextIO

from verl_hpc.tracking.histograms import Histogram, is_hist_key, split_histograms
from verl_hpc.tracking.progress import RichBar, StepRate
from verl_hpc.tracking.values import select

# names the trainers emit (verl_hpc/trainer: rl.py's step, sft.py); tracking.console_metrics adds more
KEY_PREFIXES: tuple[str, ...] = (
    "reward/score/mean", "val/", "actor/pg_loss", "actor/kl", "reward/kl", "actor/entropy",
    "actor/grad_norm", "critic/vf_loss", "prm/auc", "prm/ce_loss", "prm/pairwise_loss", "teacher/kl",
    "response_length/mean",
    "sft/", "perf/tokens_per_s",
    "timing_s/step", "async/staleness/hist/",
)
MAX_CELLS = 12
MAX_HIST_BUCKETS = 8  # buckets a histogram's line lists; n, mean and max already summarise the rest
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
    names = [n for n in select(metrics, prefixes) if not is_hist_key(n)][:MAX_CELLS]
    return [(n, format_value(metrics[n])) for n in names]


def hist_line(h: Histogram) -> str:
    """`async/staleness/hist  n=855  mean=0.0538  max=2  | 0:812 1:40 2:3`: the filled buckets."""
    filled = h.filled()
    shown = " ".join(f"{b}:{format_value(h.counts[b - h.low])}" for b in filled[:MAX_HIST_BUCKETS])
    more = f" +{len(filled) - MAX_HIST_BUCKETS} more" if len(filled) > MAX_HIST_BUCKETS else ""
    top = filled[-1] if filled else "-"
    return (f"{h.name}  n={format_value(h.total)}  mean={format_value(h.mean)}  max={top}  "
            f"| {shown or 'empty'}{more}")


def _hist_lines(metrics: Mapping[str, float], prefixes: Sequence[str]) -> list[str]:
    """A line per histogram, from the bucket keys the console's patterns choose."""
    _, hists = split_histograms({n: metrics[n] for n in select(metrics, prefixes)})
    return [hist_line(h) for h in hists]


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
        hists = _hist_lines(metrics, self.prefixes)
        if self._bar is not None:
            self._bar.console.print(self._rich_table(step, cells) if cells
                                    else f"step {step}/{self.total}")
            for line in hists:
                self._bar.console.print("  " + line, markup=False, highlight=False)
        else:
            print(self.rate.line(), file=self.stream)
            for row in text_table(cells) + ["  " + line for line in hists]:
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
