"""The output folder of a kit builder (vllm_kit.py, wheels.py): the builder writes into a folder that
is new, empty, or holds only what its own last run wrote, as that run's list file names it (the
vLLM kit's MANIFEST.json, the wheel folder's FILES). Anything else there is a user's: the builder
stops before it downloads anything, naming the folder and the foreign files, and never deletes
them. The new files are made in a partial folder inside OUT (same file system, so each move is one
rename) and published so that, at every moment, every file in OUT is named by the list file in OUT:
a run interrupted half-way leaves a folder the next run accepts.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable, List

from verl_hpc.gpu_check.vllm_pieces import KitError

PARTIAL = ".partial"  # the builder's own work folder inside OUT, removed by the next run


def foreign(out: Path, owned: Iterable[str]) -> List[str]:
    """The entries of `out` that are neither in `owned` nor the partial folder (sorted)."""
    keep = set(owned) | {PARTIAL}
    return sorted(p.name for p in out.iterdir() if p.name not in keep) if out.is_dir() else []


def refuse_foreign(out: Path, owned: Iterable[str], remedy: str) -> None:
    """KitError naming the folder and the entries this builder did not write."""
    bad = foreign(out, owned)
    if bad:
        shown = ", ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
        raise KitError(f"{out}: holds {shown}, which this command did not write; valid: a new or empty "
                       f"folder, or one holding only {remedy} (nothing was downloaded or deleted)")


def partial(out: Path) -> Path:
    """A fresh, empty partial folder in `out` (created with `out`); KitError if it cannot be written."""
    work = out / PARTIAL
    try:
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        (work / ".probe").write_bytes(b"")  # a folder one may create but not write into fails here
        (work / ".probe").unlink()
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        raise KitError(f"{out}: cannot write there ({e.strerror}); valid: a folder this user may write")
    return work


def publish(out: Path, old: Iterable[str], new: Iterable[str], list_name: str) -> None:
    """Move the partial folder's files `new` (the list file `list_name` among them) into `out`,
    replacing the previous run's files `old`: first the old files the new run does not rewrite are
    deleted (the old list still names those left), then the new list file replaces the old one,
    then the others follow (the new list names them). The partial folder is removed at the end."""
    work = out / PARTIAL
    new = list(new)
    for name in set(old) - set(new) - {list_name}:
        (out / name).unlink(missing_ok=True)
    os.replace(work / list_name, out / list_name)
    for name in new:
        if name != list_name:
            os.replace(work / name, out / name)
    shutil.rmtree(work, ignore_errors=True)


def discard(out: Path) -> None:
    """Remove the partial folder (a run that failed leaves OUT as it found it)."""
    shutil.rmtree(out / PARTIAL, ignore_errors=True)
