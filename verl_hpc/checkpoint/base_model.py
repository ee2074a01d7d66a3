"""The base model a LoRA checkpoint's adapters were trained on: its fingerprint, and the one check
that a model folder is that base.

A LoRA checkpoint holds the adapters only; the base weights stay in the run's model folder. The
checkpoint names that folder by path and fingerprint, and everything that puts the adapters back
onto a base checks the fingerprint with `check_base_model`: resuming the run (the engine,
verl_hpc/engines/megatron/lora.py) and merging them into an HF export (hf_export.py, `--model`).
It lives in the checkpoint layer so that both sides call the same rule.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from pathlib import Path

from verl_hpc.checkpoint.errors import CheckpointLayoutError

# bytes hashed at each end of every weight file
_EDGE = 1 << 20


@functools.lru_cache(maxsize=4)  # once per run: every checkpoint save records it
def base_fingerprint(model_path: str) -> str:
    """A hash naming the base model an adapter was trained on: config.json, and of every
    safetensors file its header (names, dtypes, shapes, offsets), size and first and last MiB.
    Not the whole content: reading a 70B model's 140 GB at every start and save would take
    minutes; a different model, a re-export or a truncated copy changes what is hashed."""
    folder = Path(model_path)
    h = hashlib.sha256()
    h.update((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(f.name.encode() + size.to_bytes(8, "little") + fh.read(n))
            h.update(fh.read(_EDGE))
            fh.seek(max(size - _EDGE, 8 + n))
            h.update(fh.read(_EDGE))
    return h.hexdigest()


def check_base_model(saved: dict, model_path: str, field: str = "model.path") -> None:
    """Refuse a base folder whose fingerprint differs from the one the adapters were trained on
    (`saved`: the checkpoint's LoRA record, with base_path and base_fingerprint). `field` names
    what pointed at the folder (model.path for a resume, --model for an export)."""
    try:
        mine = base_fingerprint(str(model_path))
    except (OSError, struct.error) as e:  # no config.json, an unreadable or cut safetensors file
        raise CheckpointLayoutError(f"the checkpoint's adapters were trained on the base model at "
                                    f"{saved['base_path']}; {field} = {model_path} cannot be read as that "
                                    f"model ({e}): point {field} at that base") from None
    if saved["base_fingerprint"] != mine:
        raise CheckpointLayoutError(f"the checkpoint's adapters were trained on the base model at "
                                    f"{saved['base_path']}, whose files differ from {field} = {model_path} "
                                    f"(fingerprints {saved['base_fingerprint'][:12]} vs {mine[:12]}): "
                                    f"point {field} at that base")
