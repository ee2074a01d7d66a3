"""TensorBoard event files under `<output_dir>/tensorboard` (torch's SummaryWriter).

`tensorboard --logdir outputs/` on a login node then shows every run of a project side by side.
The config goes in once as a text summary so a curve can be traced back to its settings.
`<prefix>/hist/<int>` bucket counts (histograms.py) become one histogram `<prefix>/hist` per step,
written from the counts themselves (add_histogram_raw): there are no samples to re-bin.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from verl_hpc.tracking.histograms import Histogram, split_histograms

SUBDIR = "tensorboard"


class TensorBoardBackend:
    def __init__(self, output_dir: str | os.PathLike, config: Mapping[str, Any] | None = None,
                 flush_secs: int = 30) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(output_dir) / SUBDIR
        # a shorter flush than the default 120 s: RL steps are slow and people watch live
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)
        if config:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            # indented by 4 spaces: TensorBoard renders text summaries as markdown
            self._writer.add_text("config", "\n".join("    " + ln for ln in text.splitlines()), 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        scalars, hists = split_histograms(metrics)
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)
        for h in hists:
            self._histogram(h, step)

    def _histogram(self, h: Histogram, step: int) -> None:
        filled = h.filled()
        if not filled:  # min/max of nothing: TensorBoard has no empty histogram to show
            return
        # a bucket's limit is its upper edge: integer b is the bin (b - 0.5, b + 0.5]
        self._writer.add_histogram_raw(h.name, min=filled[0], max=filled[-1], num=h.total, sum=h.sum,
                                       sum_squares=h.sum_squares, bucket_limits=h.edges()[1:],
                                       bucket_counts=list(h.counts), global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
