"""TensorBoard event files under `<output_dir>/tensorboard` (torch's SummaryWriter).

`tensorboard --logdir outputs/` on a login node then shows every run of a project side by side.
The config goes in once as a text summary so a curve can be traced back to its settings.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

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
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
