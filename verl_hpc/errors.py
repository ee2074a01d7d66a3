"""The base of every error this project raises for a user to read: the bottom layer.

Each class says, on itself, the exit code a job ends with when it escapes a rank and a short
`kind` label; `verl_hpc.runtime.errors.report` reads both from the exception, so the table of exit
codes is the classes themselves (listed in docs/errors.md, a test keeps the two equal).

This module imports nothing from verl_hpc, so that any layer can derive from it. A class that is a
refinement of another (CheckpointCorruptError is a CheckpointError) keeps its parent's code: a
script that tests for "checkpoint problem" keeps working. A class that names a different problem
declares its own code, distinct from every other.
"""
from __future__ import annotations


class VerlHpcError(Exception):
    """A problem with a one-line message written for the user: the job ends with `error: ...`
    and `exit_code` instead of a traceback."""

    exit_code: int = 1  # a subclass always declares its own (or inherits a parent's)
    kind: str = "error"

