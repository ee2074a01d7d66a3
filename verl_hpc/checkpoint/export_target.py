"""Where `python -m verl_hpc.checkpoint export` may write, checked before anything is written.

An export writes model files (safetensors shards, their index, config.json, tokenizer files). A
folder that already holds a model must not silently become a mix of two models: transformers and
vLLM follow the index, so an old index beside new shards loads the old weights. And a folder the
export reads from (the run's base model, the tokenizer folder, the checkpoint itself) must never be
written at all: a LoRA merge into its own base replaces the base weights the checkpoint's adapters
depend on, after which the run can no longer resume.

The rules, in the order `check_target` applies them:
- never a folder the export reads from, nor the checkpoint (or a folder inside it), even with
  --overwrite;
- a path that is a file, lies under a file, or cannot be created or written: refused, naming the
  option;
- an existing folder that is not empty: refused unless --overwrite. With --overwrite the export
  removes the model files it finds there (`MODEL_FILES`: weights of any format, indexes,
  config.json, tokenizer and adapter files) once its own shards are written, so the folder then
  holds exactly the new model; other files (a README, subfolders) are left alone.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Dict, List

from verl_hpc.config.errors import ConfigError

# the files that make a folder a model (what `holds a model` means): weights in any format, an index
WEIGHT_FILES = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.h5|\.msgpack|\.gguf)$|\.index\.json$")
# every file of a Hugging Face model or PEFT adapter folder that a loader reads: with --overwrite
# these are replaced, so no earlier model's file is left for transformers or vLLM to pick up
MODEL_FILES = re.compile(WEIGHT_FILES.pattern + r"|^(config|generation_config|adapter_config|tokenizer"
                         r"|tokenizer_config|special_tokens_map|added_tokens|chat_template|preprocessor_config)"
                         r"\.json$|^(chat_template\.jinja|tokenizer\.model|merges\.txt|vocab\.json|vocab\.txt)$")
OVERWRITE = ("--overwrite replaces the model files in a folder that holds a model (weights, index, "
             "config.json, tokenizer)")


def shard_limit(shard_gb: float) -> float:
    """Bytes per safetensors file from --shard-gb; a ConfigError for 0, a negative number, NaN or inf."""
    if not isinstance(shard_gb, (int, float)) or isinstance(shard_gb, bool) or not math.isfinite(shard_gb) \
            or shard_gb <= 0:
        raise ConfigError(f"--shard-gb: got {shard_gb}; valid: a number of GB > 0 (the largest safetensors "
                          "file the export writes; default 5)")
    return shard_gb * 1e9


def same_folder(a: Path, b: Path) -> bool:
    """Whether two paths name one folder (the same inode where both exist: links and bind mounts)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def model_files(folder: Path) -> List[str]:
    """The names in `folder` that make it a model folder (config.json, weight files, indexes)."""
    return sorted(f.name for f in folder.iterdir()
                  if f.name in ("config.json", "adapter_config.json") or WEIGHT_FILES.search(f.name))


def _shown(names: List[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_target(out: Path, option: str, *, overwrite: bool, reads: Dict[Path, str], checkpoint: Path) -> None:
    """Raise a one-line ConfigError naming `option` when `out` may not take the export.
    `reads`: {folder: what the export reads from it}; `checkpoint`: the checkpoint directory."""
    out = Path(out)
    for folder, what in reads.items():
        if same_folder(out, folder):
            raise ConfigError(f"{option}: '{out}' is {what}; an export never writes into a folder it reads "
                              "from, even with --overwrite; valid: another folder")
    ckpt = Path(checkpoint).resolve()
    if same_folder(out, ckpt) or ckpt in out.resolve().parents:
        raise ConfigError(f"{option}: '{out}' is inside the checkpoint {ckpt}; valid: a folder outside it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{option}: '{out}' is a file, not a folder; valid: a new or empty folder")
    probe = out.absolute()
    while not probe.exists():  # the nearest existing ancestor decides whether `out` can be made
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{option}: '{probe}' is a file, not a folder (needed to create '{out}'); valid: a "
                          "folder that can be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}: '{probe}' is not writable by this user; valid: a writable folder")
    if probe != out.absolute() or overwrite:
        return
    held = model_files(out)
    if held:
        raise ConfigError(f"{option}: '{out}' holds a model ({_shown(held)}); an export does not replace it "
                          f"unless told to: name a new folder, or pass --overwrite ({OVERWRITE})")
    others = sorted(f.name for f in out.iterdir())
    if others:
        raise ConfigError(f"{option}: '{out}' is not empty ({_shown(others)}); valid: a new or empty folder, "
                          "or --overwrite to write the export beside those files")


def make_folder(out: Path, option: str) -> None:
    """Create `out` (and its parents); a ConfigError naming `option` when the file system refuses
    (a read-only mount, /proc, a full disk)."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option}: cannot create '{out}': {e.strerror or e}; valid: a folder this user "
                          "can create and write") from None


def remove_stale(out: Path, keep: List[str]) -> List[str]:
    """Remove the model files in `out` that the new export did not write (an earlier model's shards,
    index, tokenizer); returns their names."""
    gone = sorted(f.name for f in Path(out).iterdir()
                  if f.is_file() and MODEL_FILES.search(f.name) and f.name not in keep)
    for name in gone:
        (Path(out) / name).unlink()
    return gone
