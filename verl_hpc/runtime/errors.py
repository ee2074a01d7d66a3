"""Known error classes -> the one line a user reads and the exit code a script can test.

A data, reward, checkpoint or config problem raised inside a rank is the user's to fix, and the
traceback around it only hides the line that says how. `report` prints `error: <message>` (rank
0) or `error: rank N: <message>` (another rank) once per failing rank and returns the class's
exit code; an unknown exception is not ours to summarise and keeps its traceback (exit code 1).
The table is docs/errors.md's.
"""
from __future__ import annotations

import logging
import sys
import traceback
from typing import List, Optional, Tuple, Type

log = logging.getLogger(__name__)


def _classes() -> List[Tuple[Type[BaseException], int, str]]:
    """(class, exit code, what it is); imported lazily: each layer's error module is tiny."""
    from verl_hpc.checkpoint.errors import CheckpointError
    from verl_hpc.config.errors import ConfigError
    from verl_hpc.data.errors import DataError
    from verl_hpc.models.hf_checkpoint import WeightFileError
    from verl_hpc.resharding.sync import SyncError
    from verl_hpc.rewards.errors import RewardError
    from verl_hpc.rollout.prompts import PromptTooLongError
    from verl_hpc.runtime.watchdog import StageStalledError
    from verl_hpc.trainer.guard import NonFiniteError

    return [(ConfigError, 2, "config"), (DataError, 10, "data"), (PromptTooLongError, 10, "data"),
            (RewardError, 11, "reward"), (CheckpointError, 12, "checkpoint"), (WeightFileError, 13, "weights"),
            (NonFiniteError, 14, "non-finite loss"), (SyncError, 15, "weight sync"),
            (StageStalledError, 16, "stalled rank")]


def exit_code_for(exc: BaseException) -> Optional[int]:
    for cls, code, _ in _classes():
        if isinstance(exc, cls):
            return code
    return None


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
