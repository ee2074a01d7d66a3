"""Filesystem steps of the atomic protocol, all done by rank 0: commit, `latest`, retention, cleanup.

    root/step_000120.tmp-<token>/   every rank writes its file here; rank 0 adds index.json
        -> fsync files (each rank), fsync this directory
    os.replace -> root/step_000120/ ; fsync root        (the checkpoint now exists, complete)
    root/latest.tmp-<token> -> os.replace -> root/latest ; fsync root   ("step_000120\\n")

A crash before the first os.replace leaves only a .tmp- directory (removed by the next save);
between the two, a complete checkpoint that `latest` does not name yet (still the previous one).
Retention renames a doomed checkpoint to a .tmp- name first, so a crash while deleting it never
leaves a half-deleted directory that looks like a checkpoint.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from verl_hpc.checkpoint.errors import CheckpointError
from verl_hpc.checkpoint.index import INDEX, LATEST, TMP_MARK

log = logging.getLogger("verl_hpc.checkpoint")
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{int(step):06d}"


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # a few filesystems refuse fsync on directories; nothing more can be done
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, token: str) -> None:
    tmp = path.with_name(f"{path.name}{TMP_MARK}{token}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def commit(tmp_dir: Path, final_dir: Path, token: str) -> None:
    """Publish a fully written temporary directory, then point `latest` at it."""
    fsync_dir(tmp_dir)
    if final_dir.exists():
        raise CheckpointError(f"{final_dir} already exists: a step is saved once (delete it to save again)")
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    atomic_write_text(final_dir.parent / LATEST, final_dir.name + "\n", token)


def list_checkpoints(root) -> list[Path]:
    """Complete checkpoints under root, oldest commit first."""
    found = []
    for p in Path(root).iterdir() if Path(root).is_dir() else []:
        m = STEP_DIR.match(p.name)
        if m and (p / INDEX).is_file():
            try:
                created = float(json.loads((p / INDEX).read_text()).get("created_unix", 0))
            except (ValueError, OSError):
                created = 0.0  # a damaged index sorts first, so retention removes it first
            found.append((created, int(m.group(1)), p))
    return [p for *_, p in sorted(found)]


def remove_checkpoint(path: Path, token: str) -> None:
    """Delete a committed checkpoint folder: renamed first (one atomic step, so a reader never
    sees a half-deleted checkpoint under its committed name), then removed."""
    doomed = path.with_name(f"{path.name}{TMP_MARK}deleting-{token}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def apply_retention(root, keep_last: int, token: str) -> list[Path]:
    """Keep the `keep_last` most recently committed checkpoints (0 = all) and latest's target."""
    if keep_last <= 0:
        return []
    latest = (Path(root) / LATEST).read_text().strip() if (Path(root) / LATEST).is_file() else None
    ckpts = list_checkpoints(root)
    doomed = [p for p in ckpts[:-keep_last] if p.name != latest]
    for p in doomed:
        log.info("checkpoint retention (keep_last=%d): removing %s", keep_last, p)
        remove_checkpoint(p, token)
    return doomed


def clean_stale(root, before: float) -> list[Path]:
    """Remove leftovers of interrupted saves (names with .tmp-) last touched before `before`."""
    removed = []
    for p in Path(root).iterdir():
        if TMP_MARK in p.name and p.lstat().st_mtime < before:
            log.warning("removing %s: left by an interrupted checkpoint save", p)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def new_token() -> str:
    return f"{int(time.time())}-{os.urandom(4).hex()}"
