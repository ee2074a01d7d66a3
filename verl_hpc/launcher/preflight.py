"""What can be checked on a login node before a job waits in the queue (`submit`, `--dry-run`).

The config checks (verl_hpc/config/validate.py) look at values; these look at the files the
values name, cheaply (footers, headers, first lines: never a whole data set or a weight), so that
a missing data file, a truncated safetensors file or an unsupported architecture fails in a second
here instead of after hours in the queue. One line per problem, naming the file and what is valid:

- data files (data.train_files/val_files for RL, data.sft_files for SFT): exist, are parquet
  (footer and schema readable, the needed columns present) or JSONL (the first lines are UTF-8
  JSON objects with the needed fields);
- model folders (model.path, critic.model_path, reward.reward_model.path): config.json names a
  supported architecture, each *.safetensors header is readable and its tensors end exactly at
  the end of the file, an index's weight_map names files that exist;
- output folders (trainer.output_dir, checkpoint.dir, slurm.log_dir up to its first %): a
  directory (not a file) this user can write, or creatable under one;
- `latest` in checkpoint.dir (and in trainer.resume when it is a folder) names a checkpoint inside
  that folder, never a path out of it.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import List

from verl_hpc.config import ConfigError
from verl_hpc.config.errors import raise_if_any

JSONL_LINES_CHECKED = 5
_STEP_NAME = re.compile(r"^step_\d+$")


def preflight(cfg, check_model: bool = True) -> None:
    """Raise one ConfigError listing every problem found in the files the config names."""
    problems = _data(cfg) + _outputs(cfg) + _resume(cfg)
    if check_model:
        for field, path in _model_folders(cfg):
            problems += model_folder_problems(path, field)
    raise_if_any(problems)


# ------------------------------------------------------------------------------ data
def _data(cfg) -> List[str]:
    d, job = cfg.data, cfg.trainer.job
    sets = []
    if job == "rl":
        needed = (d.prompt_key, "data_source", "ground_truth")
        sets = [("data.train_files", f, needed) for f in d.train_files]
        sets += [("data.val_files", f, needed) for f in d.val_files]
    elif job == "sft":
        sets = [("data.sft_files", f, (d.prompt_key, d.response_key)) for f in d.sft_files]
    problems = []
    for field, path, needed in sets:
        problem = data_file_problem(path, needed)
        if problem:
            problems.append(f"{field}: {problem}")
    return problems


def data_file_problem(path: str, needed) -> str:
    """'' or what is wrong with one data file, judged from its footer or first lines."""
    from verl_hpc.data.records import JSONL_SUFFIXES, PARQUET_SUFFIXES

    p = Path(path)
    if not p.exists():
        return f"'{path}': no such file"
    if not p.is_file():
        return f"'{path}' is a {'folder' if p.is_dir() else 'special file'}; expected a parquet or JSONL file"
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.ParquetFile(path).schema_arrow
        except (pa.ArrowException, OSError) as e:
            return f"'{path}': not a readable parquet file (footer: {e}); expected a complete parquet file"
        missing = [c for c in needed if c not in schema.names]
        return (f"'{path}': no column {', '.join(repr(c) for c in missing)} (columns: {', '.join(schema.names)})"
                if missing else "")
    if lower.endswith(JSONL_SUFFIXES):
        return _jsonl_problem(p, needed)
    return f"'{path}': unknown file type; valid: {', '.join(PARQUET_SUFFIXES + JSONL_SUFFIXES)}"


def _jsonl_problem(p: Path, needed) -> str:
    seen = 0
    with open(p, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                return f"'{p}' line {line_no}: byte 0x{raw[e.start]:02x} is not UTF-8; JSONL files must be UTF-8"
            except json.JSONDecodeError as e:
                return f"'{p}' line {line_no}: invalid JSON ({e.msg} at column {e.colno}); expected one object per line"
            if not isinstance(row, dict):
                return f"'{p}' line {line_no}: expected a JSON object, got {type(row).__name__}"
            missing = [c for c in needed if c not in row]
            if missing:
                return f"'{p}' line {line_no}: no field {', '.join(repr(c) for c in missing)} (fields: {', '.join(row)})"
            seen += 1
            if seen >= JSONL_LINES_CHECKED:
                break
    return "" if seen else f"'{p}': no rows (the file is empty)"


# ------------------------------------------------------------------------------ models
def _model_folders(cfg):
    out = [("model.path", cfg.model.path)] if cfg.model.path else []
    if cfg.critic.wanted(cfg) and cfg.critic.model_path and cfg.critic.model_path != cfg.model.path:
        out.append(("critic.model_path", cfg.critic.model_path))
    if cfg.reward.reward_model.enable and cfg.reward.reward_model.path:
        out.append(("reward.reward_model.path", cfg.reward.reward_model.path))
    return out


def model_folder_problems(path: str, field: str) -> List[str]:
    folder = Path(path)
    if not folder.is_dir():
        return []  # validate() already says so
    problems = []
    if field != "reward.reward_model.path":  # a reward model may be any sequence classifier
        from verl_hpc.models.config_mapping import load_hf_config, parse_hf_config

        try:
            parse_hf_config(load_hf_config(folder), str(folder / "config.json"))
        except ConfigError as e:
            problems.append(f"{field}: {e}")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        problems.append(f"{field}: '{folder}' has no *.safetensors files; expected a Hugging Face model folder")
    for f in weights:
        problem = safetensors_problem(f)
        if problem:
            problems.append(f"{field}: {problem}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{field}: '{index}' is not a safetensors index (a JSON object with weight_map): {e}")
        else:
            gone = sorted(n for n in names if not (folder / n).is_file())
            if gone:
                problems.append(f"{field}: '{index}' names missing file(s): {', '.join(gone)}")
    return problems


def safetensors_problem(path: Path) -> str:
    """'' or why a safetensors file is not whole: an 8-byte little-endian header length, a JSON
    header, then the tensors, whose last data_offsets end must be exactly the end of the file (a
    copy cut short ends earlier). Read by hand: the safetensors library would map the whole file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"'{path}': {size} bytes, too short for a safetensors header (truncated or not safetensors)"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            return f"'{path}': header length {n} exceeds the file ({size} bytes): truncated or not safetensors"
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            return f"'{path}': the safetensors header is not valid JSON ({e}): damaged or not safetensors"
    if not isinstance(header, dict):
        return f"'{path}': the safetensors header is not a JSON object"
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    expected = 8 + n + max(ends, default=0)
    if expected != size:
        what = "truncated" if expected > size else "has trailing bytes"
        return f"'{path}': {what}: its header covers {expected} bytes, the file has {size}"
    return ""


# ------------------------------------------------------------------------------ outputs
def _outputs(cfg) -> List[str]:
    t = cfg.trainer
    dirs = [("trainer.output_dir", t.output_dir),
            ("checkpoint.dir", cfg.checkpoint.dir or os.path.join(t.output_dir, "checkpoints"))]
    log_dir = cfg.slurm.log_dir.split("%", 1)[0]  # %j and friends are filled in by Slurm
    if log_dir:
        dirs.append(("slurm.log_dir", log_dir))
    return [p for field, d in dirs if (p := writable_dir_problem(d, field))]


def writable_dir_problem(path: str, field: str) -> str:
    p = Path(path).absolute()
    probe = p
    while not probe.exists():  # the nearest existing ancestor decides whether we can create it
        probe = probe.parent
    if not probe.is_dir():
        return (f"{field}: '{probe}' is a file, not a folder" + (f" (needed to create '{p}')" if probe != p else "")
                + "; valid: a writable folder or a path that can be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{field}: '{probe}' is not writable by this user; valid: a writable folder"
    return ""


# ------------------------------------------------------------------------------ resume
def _resume(cfg) -> List[str]:
    roots = [("checkpoint.dir", cfg.checkpoint.dir or os.path.join(cfg.trainer.output_dir, "checkpoints"))]
    if cfg.trainer.resume not in ("auto", "never") and Path(cfg.trainer.resume).is_dir():
        roots.append(("trainer.resume", cfg.trainer.resume))
    return [p for field, root in roots if (p := latest_problem(Path(root), field))]


def latest_problem(root: Path, field: str) -> str:
    """'' or why `root/latest` does not name a checkpoint folder inside `root`."""
    from verl_hpc.checkpoint.index import INDEX, LATEST

    latest = root / LATEST
    if not latest.exists():
        return ""
    if not latest.is_file():
        return f"{field}: '{latest}' is not a file; expected a one-line file naming a step_NNNNNN folder"
    name = latest.read_text(errors="replace").strip()
    if not _STEP_NAME.match(name):
        return (f"{field}: '{latest}' names {name!r}; valid: a step_NNNNNN folder inside '{root}' "
                "(no path, no '..')")
    if not (root / name / INDEX).is_file():
        return f"{field}: '{latest}' names {name!r}, which is missing or incomplete (no {INDEX})"
    return ""
