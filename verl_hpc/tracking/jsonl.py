"""`<output_dir>/metrics.jsonl`: one JSON object per logged step, appended, resumable.

A line is `{"step": 12, "time": 1718000000.1, "reward/score/mean": 0.5, ...}`; NaN/inf are
written as null and their names listed under `nonfinite`, so the file stays strict JSON that any
tool reads.

Resume: a job restarted from a checkpoint at step k replays steps k, k+1, ...; lines the first
attempt wrote for those steps describe a trajectory that no longer exists, so they are dropped
(`truncate_from(k)`) before the replay appends its own. Without an explicit start step the writer
does the same lazily at its first write, which covers callers that never heard of resuming.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

from verl_hpc.tracking.values import json_safe, nonfinite_names

log = logging.getLogger(__name__)

FILENAME = "metrics.jsonl"


def _parse(line: str) -> dict[str, Any] | None:
    """A line written by a killed process can be cut short: skip it rather than fail the reader."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return None
    return row


def read_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All well-formed rows in file order; null values come back as NaN (a gap in a plot)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = _parse(line)
            if row is not None:
                rows.append({k: (math.nan if v is None else v) for k, v in row.items()})
    return rows


def lines_until(path: str | os.PathLike, step: int) -> str:
    """The well-formed lines of rows with step <= `step`, as written (for a checkpoint to carry)."""
    path = Path(path)
    if not path.exists():
        return ""
    with path.open(encoding="utf-8") as f:
        return "".join(line if line.endswith("\n") else line + "\n" for line in f
                       if (row := _parse(line)) is not None and row["step"] <= step)


def restore_lines(path: str | os.PathLike, text: str, step: int) -> bool:
    """Put a checkpoint's history (`lines_until` of the saving run) back when this file has fewer
    rows up to `step` than it (a resume into a new output_dir, or a lost file); rows after `step`
    are the resumed run's to rewrite. Atomic (temporary file + os.replace). True if written."""
    path = Path(path)
    have = lines_until(path, step).count("\n")
    if text.count("\n") <= have:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    log.info("tracking: %s: %d row(s) up to step %d restored from the checkpoint", path,
             text.count("\n"), step)
    return True


def truncate_from(path: str | os.PathLike, step: int) -> int:
    """Drop rows with step >= `step` (and unreadable lines); returns how many rows were dropped.

    Rewrites through a temporary file and os.replace, so a crash here leaves the old file whole.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped, unterminated = [], 0, False
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = _parse(line)
            if row is not None and row["step"] < step:
                # a kill between the JSON and its newline would glue the next append onto it
                unterminated = not line.endswith("\n")
                kept.append(line if not unterminated else line + "\n")
            elif line.strip():
                dropped += 1
    if dropped or unterminated:
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        log.info("tracking: %s: dropped %d row(s) from step %d on (resumed run)", path, dropped, step)
    return dropped


class JsonlBackend:
    """Appends one line per log call and flushes it, so `tail -f` and a killed job see every step."""

    def __init__(self, output_dir: str | os.PathLike, start_step: int | None = None) -> None:
        self.path = Path(output_dir) / FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._resume_checked = start_step is not None
        if start_step is not None:
            truncate_from(self.path, start_step)
        self._file = self.path.open("a", encoding="utf-8")

    def truncate_from(self, step: int) -> int:
        self._file.close()
        try:
            return truncate_from(self.path, step)
        finally:
            self._file = self.path.open("a", encoding="utf-8")
            self._resume_checked = True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._resume_checked:
            self.truncate_from(step)
        row: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        row.update(json_safe(metrics))
        bad = nonfinite_names(metrics)
        if bad:
            row["nonfinite"] = bad
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
