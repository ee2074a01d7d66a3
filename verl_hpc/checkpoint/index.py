"""`index.json`: the map from each global tensor to its pieces, plus step, metadata and writer layout.

Written by rank 0 once every rank's file is closed and synced, as the last file of the temporary
directory, so a checkpoint directory with a valid index is complete. The index carries the CRC32
of its own canonical JSON (`index_crc32`): a flipped digit in a shape or offset is caught too.

    {"format": "verl_hpc.checkpoint", "version": 1, "step": 120, "created_unix": ..., "created": ...,
     "world_size": 4, "layout": {"tp": 2, "pp": 2, "dp": 1},          # of the writer; information only
     "files": [{"name": "rank_00000.h5", "rank": 0, "bytes": 123}, ...],
     "tensors": {"decoder.layers.0.mlp.linear_fc1.weight": {"global_shape": [512, 128],
                 "dtype": "bfloat16", "pieces": [{"file": "rank_00000.h5",
                 "dataset": "/tensors/decoder.layers.0.mlp.linear_fc1.weight",
                 "offsets": [0, 0], "shape": [256, 128]}, ...]}, ...},
     "metadata": {...the JSON-able dict handed to save_checkpoint...},
     "index_crc32": 1234567}
"""
from __future__ import annotations

import datetime
import json
import reprlib
import time
import zlib
from pathlib import Path

from verl_hpc.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from verl_hpc.checkpoint.rankfile import FORMAT, VERSION

INDEX = "index.json"
LATEST = "latest"
TMP_MARK = ".tmp-"
REQUIRED = ("step", "world_size", "files", "tensors", "metadata")


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def build_index(*, step: int, world_size: int, layout, files: list, tensors: dict, metadata: dict) -> str:
    now = time.time()
    body = dict(format=FORMAT, version=VERSION, step=int(step), created_unix=now,
                created=datetime.datetime.fromtimestamp(now).astimezone().isoformat(timespec="seconds"),
                world_size=world_size, layout=layout, files=files, tensors=tensors, metadata=metadata)
    body = json.loads(json.dumps(body))  # what a reader will parse (tuples -> lists) is what gets the CRC
    body["index_crc32"] = zlib.crc32(_canonical(body))
    return json.dumps(body, indent=1) + "\n"


def read_index(ckpt: Path) -> dict:
    path = Path(ckpt) / INDEX
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        hint = " (a .tmp- directory is a save that never finished)" if TMP_MARK in Path(ckpt).name else ""
        raise CheckpointNotFoundError(f"{ckpt} is not a complete checkpoint: {INDEX} is missing{hint}") from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path} is not valid JSON (torn or truncated write?): {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path} is not a {FORMAT} index")
    if body.get("version") != VERSION:
        raise CheckpointCorruptError(f"{path} has format version {body.get('version')}; this code reads {VERSION}")
    stored = body.pop("index_crc32", None)
    if stored != zlib.crc32(_canonical(body)):
        raise CheckpointCorruptError(f"{path} fails its checksum (index_crc32): the index was altered or damaged")
    missing = [k for k in REQUIRED if k not in body]
    if missing:
        raise CheckpointCorruptError(f"{path} lacks {missing}")
    return body


def resolve(path) -> Path:
    """A checkpoint directory (has index.json) or a root with a `latest` pointer -> the directory."""
    p = Path(path)
    if (p / INDEX).exists():
        return p
    if (p / LATEST).is_file():
        name = read_latest(p)
        if Path(name).name != name or name in ("", ".", ".."):  # a path would point out of the root
            raise CheckpointNotFoundError(f"{p / LATEST} names {name!r}; it must name a checkpoint folder "
                                          f"inside {p} (no '/' or '..')")
        target = p / name
        if not name or not (target / INDEX).exists():
            raise CheckpointNotFoundError(f"{p / LATEST} points to {name!r}, which is missing or incomplete")
        return target
    if TMP_MARK in p.name:
        read_index(p)  # raises the 'never finished' error
    raise CheckpointNotFoundError(
        f"no checkpoint at {p}: expected a checkpoint directory (with {INDEX}) or a checkpoint root "
        f"(with a {LATEST} file)")


def read_latest(root: Path) -> str:
    """The folder name `root/latest` holds. Anything else (binary bytes, a control character) is
    damage to the checkpoint root, named, not a decoding traceback."""
    path = root / LATEST
    raw = path.read_bytes()
    expected = "expected one line naming a checkpoint folder, e.g. 'step_000120'"
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(f"{path} is not text: byte {e.start} is {raw[e.start:e.start + 1]!r}, "
                                     f"not UTF-8; {expected}") from None
    if not name.isprintable():
        raise CheckpointCorruptError(f"{path} holds {reprlib.repr(name)}, with a control character; {expected}")
    return name


def find_latest(root) -> Path | None:
    """The checkpoint `root/latest` names, or None when nothing was ever committed under root."""
    if not (Path(root) / LATEST).is_file():
        return None
    return resolve(root)
