"""Lazy, slice-wise reading of a Hugging Face safetensors checkpoint (single file or sharded).

Each rank reads only the rows/columns it owns, through `safe_open(...).get_slice(name)[index]`,
which maps the file and copies just the selected region: a 70B checkpoint is never materialised
whole on a rank. `bytes_read` counts what was actually copied out (for logs and tests).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.errors import VerlHpcError


class WeightFileError(VerlHpcError, ValueError):
    """A safetensors file that cannot be opened (truncated, damaged, not safetensors); names it."""

    exit_code, kind = 13, "weights"


def open_safetensors(path):
    """safe_open with the file named in the error (safetensors' own SafetensorError says only
    e.g. 'MetadataIncompleteBuffer', not which of a model's files is bad)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise WeightFileError(f"'{path}': cannot open as safetensors ({e}); the file is truncated, damaged "
                              "or not safetensors (re-copy or re-save it)") from None


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _weight_map(folder: Path) -> Dict[str, str]:
    """tensor name -> file name, from the index or from the single file's header."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ConfigError(f"{index} lists files that are not in {folder}: {', '.join(missing)}")
        return dict(weight_map)
    files = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(
        folder.glob("*.safetensors"))
    if len(files) != 1:
        found = "several .safetensors files but no index" if files else "no .safetensors file"
        raise ConfigError(f"model.path: {folder} has {found}; expected {SINGLE_FILE} or "
                          f"{INDEX_FILE} with its shards (.bin checkpoints are not supported: "
                          f"re-save with safe_serialization=True)")
    with open_safetensors(files[0]) as f:
        return {name: files[0].name for name in f.keys()}


class HFCheckpointReader:
    """Read tensors or slices of tensors by HF name; files are opened once, on first use."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConfigError(f"model.path: {str(folder)!r} is not a folder")
        self.weight_map = _weight_map(self.folder)
        self._handles: Dict[str, object] = {}
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise WeightFileError(f"{self.folder}: the checkpoint has no tensor {name!r} (does config.json "
                                  f"match the weights? e.g. tie_word_embeddings, num_hidden_layers)")
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(self.folder / fname)
        return self._handles[fname].get_slice(name)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._slice(name).get_dtype()]

    def read(self, name: str, index: Optional[Tuple[slice, ...]] = None) -> torch.Tensor:
        """The tensor `name`, or only `name[index]` (a tuple of slices, one per leading dim)."""
        sl = self._slice(name)
        if index is None:
            index = tuple(slice(None) for _ in sl.get_shape())
        t = sl[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
