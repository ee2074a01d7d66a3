"""The metric history a training checkpoint carries, and its restore on resume.

    history = MetricHistory(cfg.trainer.output_dir)
    rank_state.update(history.snapshot(step))     # rank 0, when saving: the JSONL rows up to step
    history.restore(reader.rank_state(0), step)   # rank 0, when resuming

Why a checkpoint carries it: a resumed run (possibly into a new output_dir, or after the file was
lost) should still plot and report the whole run. The rows after `step` are the resumed run's to
rewrite; the tracker drops them when it opens the file (Tracker(start_step=...)). Without the
jsonl backend there is no file and the snapshot is empty.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Mapping

from verl_hpc.tracking.jsonl import FILENAME, lines_until, restore_lines

HISTORY_KEY = "metrics_jsonl"  # the key in rank 0's per-rank checkpoint state


class MetricHistory:
    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / FILENAME

    def snapshot(self, step: int) -> Dict[str, bytes]:
        """{HISTORY_KEY: the JSONL rows with step <= `step`}, or {} when there are none."""
        text = lines_until(self.path, step)
        return {HISTORY_KEY: text.encode()} if text else {}

    def restore(self, rank_state: Mapping[str, Any], step: int) -> bool:
        """Put the saved rows back where this run's file has fewer up to `step`; True if written."""
        saved = rank_state.get(HISTORY_KEY)
        if isinstance(saved, (bytes, bytearray)) and saved:
            return restore_lines(self.path, bytes(saved).decode("utf-8"), step)
        return False
