"""Errors of the checkpoint layer. Each message names the checkpoint, file, dataset or tensor at fault."""
from __future__ import annotations

from verl_hpc.errors import VerlHpcError


class CheckpointError(VerlHpcError, RuntimeError):
    """Base class: a checkpoint could not be written or read. Each refinement below has its own exit
    code, so a script can tell a missing checkpoint from a damaged one."""

    exit_code, kind = 12, "checkpoint"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint where one was asked for, or a file/dataset/piece it needs is missing."""

    exit_code, kind = 21, "checkpoint not found"


class CheckpointCorruptError(CheckpointError):
    """Bytes on disk disagree with their checksum, or the index and a file disagree."""

    exit_code, kind = 22, "checkpoint corrupt"


class CheckpointLayoutError(CheckpointError, ValueError):
    """The tensors handed to save/load do not describe a consistent layout (shapes, dtypes, slabs)."""

    exit_code, kind = 23, "checkpoint layout"


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is sound but not one this run can continue: another program (trainer.job),
    roles or settings than the run that saved it, or steps this run would save again."""

    exit_code, kind = 28, "checkpoint mismatch"
