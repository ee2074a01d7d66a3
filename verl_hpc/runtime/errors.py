"""Known error classes -> the one line a user reads and the exit code a script can test.

A data, reward, checkpoint or config problem raised inside a rank is the user's to fix, and the
traceback around it only hides the line that says how. `report` prints `error: <message>` (rank
0) or `error: rank N: <message>` (another rank) once per failing rank and returns the class's
exit code; an unknown exception is not ours to summarise and keeps its traceback (exit code 1).
Each class carries its own code (`VerlHpcError.exit_code`), so this layer imports no higher one;
docs/errors.md lists them.
"""
from __future__ import annotations

import logging
import sys
import traceback
from typing import Optional

from verl_hpc.errors import VerlHpcError

log = logging.getLogger(__name__)


def exit_code_for(exc: BaseException) -> Optional[int]:
    """The exit code the exception's class declares (verl_hpc.errors); None for any other error."""
    return exc.exit_code if isinstance(exc, VerlHpcError) else None


def one_line(exc: BaseException) -> str:
    """The message as one line: an error listing several problems keeps them, joined by '; '."""
    text = str(exc).strip() or type(exc).__name__
    return "; ".join(part.strip(" -") for part in text.splitlines() if part.strip())


def report(exc: BaseException, rank: int) -> Optional[int]:
    """Print the one-line error of a known class and return its exit code; None for others."""
    code = exit_code_for(exc)
    if code is None:
        return None
    log.debug("%s", "".join(traceback.format_exception(exc)))  # VERL_HPC_LOGLEVEL=DEBUG shows it
    where = "" if rank == 0 else f"rank {rank}: "
    print(f"error: {where}{one_line(exc)}", file=sys.stderr, flush=True)
    return code
