"""Which namespace (`trainer.namespace`) a checkpoint belongs to, and the refusal to cross one.

Namespaces keep teams' jobs on one cluster apart: their folders differ by construction (the
config puts the namespace into every path), but an explicit `checkpoint.dir` or `trainer.resume`
path can still point at another team's checkpoints. The namespace is recorded in each checkpoint's
index metadata (`metadata.namespace`); a job refuses to load one of another namespace or to save
into a folder whose latest checkpoint is of another namespace. Checkpoints written before
namespaces existed count as the empty namespace, like a job that sets none.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from verl_hpc.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from verl_hpc.checkpoint.index import read_index, resolve

KEY = "namespace"


class CheckpointNamespaceError(CheckpointError):
    """A checkpoint written under another trainer.namespace."""

    exit_code, kind = 24, "checkpoint namespace"


def recorded_namespace(path) -> Optional[str]:
    """The namespace of the checkpoint at `path` (a checkpoint or a root with `latest`); None when
    there is no committed checkpoint there."""
    try:
        ckpt = resolve(path)
    except CheckpointNotFoundError:
        return None
    return str(read_index(ckpt)["metadata"].get(KEY) or "")


def check_namespace(path, namespace: str, action: str) -> None:
    """Raise when the checkpoint at `path` belongs to another namespace. action: 'resume from' /
    'save into' (for the message)."""
    owner = recorded_namespace(path)
    if owner is None or owner == (namespace or ""):
        return
    def name(ns: str) -> str:
        return f"namespace '{ns}'" if ns else "no namespace"

    raise CheckpointNamespaceError(
        f"refusing to {action} {Path(path)}: its checkpoints belong to {name(owner)}, this job has "
        f"trainer.namespace='{namespace}'; point checkpoint.dir / trainer.resume at this namespace's "
        "own checkpoints")
