"""Errors of the checkpoint layer. Each message names the checkpoint, file, dataset or tensor at fault."""
from __future__ import annotations

from verl_hpc.errors import VerlHpcError


class CheckpointError(VerlHpcError, RuntimeError):
    """Base class: a checkpoint could not be written or read. Its subclasses keep its exit code."""

    exit_code, kind = 12, "checkpoint"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint where one was asked for, or a file/dataset/piece it needs is missing."""


class CheckpointCorruptError(CheckpointError):
    """Bytes on disk disagree with their checksum, or the index and a file disagree."""


class CheckpointLayoutError(CheckpointError, ValueError):
    """The tensors handed to save/load do not describe a consistent layout (shapes, dtypes, slabs)."""
