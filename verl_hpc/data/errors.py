"""The one exception type of the data layer.

A bad data row must never end in a bare traceback deep inside the trainer: every problem becomes
one line naming the file, the row (and the JSONL line), the field, and what would be valid. Problems
found together travel in one `DataError`, so a user fixes a file in one round.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from verl_hpc.errors import VerlHpcError

MAX_LISTED = 10  # beyond this, a summary count: a broken file would otherwise flood the terminal


class DataError(VerlHpcError, ValueError):
    """A bad data file, row or sampler state. `str(e)` names the file/row/field at fault."""

    exit_code, kind = 10, "data"

    def __init__(self, message: str, problems: Optional[Sequence[str]] = None):
        self.problems: List[str] = list(problems) if problems else [message]
        super().__init__(message)

    @classmethod
    def from_problems(cls, problems: Sequence[str], total: Optional[int] = None) -> "DataError":
        total = len(problems) if total is None else total
        if total == 1:
            return cls(problems[0])
        shown = list(problems[:MAX_LISTED])
        lines = [f"{total} problems in the data:"] + [f"  - {p}" for p in shown]
        if total > len(shown):
            lines.append(f"  ... and {total - len(shown)} more")
        return cls("\n".join(lines), problems)
