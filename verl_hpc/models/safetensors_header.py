"""A safetensors file's header, read without its tensors: the names, shapes and dtypes a model
folder holds (the pre-queue checks of the launcher and the rollout's vLLM support probe)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

HeaderEntry = Tuple[Tuple[int, ...], str, str]  # shape, dtype, file name


def read_header(path: Path) -> Tuple[Optional[dict], str]:
    """(header, '') or (None, why the file is not a whole safetensors file): an 8-byte little-endian
    header length, a JSON header, then the tensors, whose last data_offsets end must be exactly
    the end of the file (a copy cut short ends earlier). Read by hand: the safetensors library
    would map the whole file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, f"'{path}': {size} bytes, too short for a safetensors header (truncated or not safetensors)"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            return None, f"'{path}': header length {n} exceeds the file ({size} bytes): truncated or not safetensors"
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            return None, f"'{path}': the safetensors header is not valid JSON ({e}): damaged or not safetensors"
    if not isinstance(header, dict):
        return None, f"'{path}': the safetensors header is not a JSON object"
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    expected = 8 + n + max(ends, default=0)
    if expected != size:
        what = "truncated" if expected > size else "has trailing bytes"
        return None, f"'{path}': {what}: its header covers {expected} bytes, the file has {size}"
    return header, ""


def tensors_of(headers: Dict[Path, dict]) -> Dict[str, HeaderEntry]:
    """{tensor name: (shape, dtype, file name)} over every file's header."""
    out = {}
    for path, header in headers.items():
        for name, t in header.items():
            if name != "__metadata__" and isinstance(t, dict):
                out[name] = (tuple(t.get("shape", ())), str(t.get("dtype")), path.name)
    return out
