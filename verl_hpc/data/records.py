"""Prompt records read from parquet or JSONL files and validated row by row.

A row has the prompt under `prompt_key` (plain text, or chat messages: a list of {role, content}),
`data_source` (routes the row to its reward function), `ground_truth` (the reference answer, a
string or a number), an optional `extra` dict handed to the reward function untouched, and for
multi-turn rollout an optional `tools` list: the names of the tools its episodes may call.

Each record gets a stable id `<file name>:<row>` (row = 0-based index of the record in its file,
blank JSONL lines not counted), so a failing reward or an overlong prompt can be traced back to
the line that caused it. Both formats are read with pyarrow; for JSONL that pyarrow cannot type
(a field that is a number in one row and a string in another, which hand-written files often
have) or cannot parse, the file is re-read line by line with `json` so the error names the line.

Arrow stores a column of dicts with one schema, so a key present in some rows' `extra` reads as
None in the others; None values in `extra` (and in message dicts) are therefore dropped, for
parquet and JSONL alike, so a reward function sees the same dict whichever format it came from.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from verl_hpc.data.errors import DataError

VALID_ROLES = ("system", "user", "assistant", "tool")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")

Messages = List[Dict[str, str]]


@dataclass
class PromptRecord:
    id: str  # "<file name>:<row>"
    prompt: Union[str, Messages]  # text, or chat messages [{role, content}, ...]
    data_source: str
    ground_truth: str  # numbers are kept as their text ("72", "0.5")
    extra: Dict[str, Any] = field(default_factory=dict)
    # the row's images as stored (bytes, paths, {bytes, path}); decoded by verl_hpc.data.images
    images: Optional[List[Any]] = None
    base_dir: str = ""  # the data file's folder: relative image paths resolve against it

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


def read_rows(path: str, what: str = "data file") -> List[Dict[str, Any]]:
    """All rows of a parquet or JSONL file as plain dicts; a DataError names the file otherwise."""
    if not os.path.isfile(path):
        raise DataError(f"{what} '{path}': no such file")
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{what} '{path}': not a readable parquet file ({e})") from e
    if lower.endswith(JSONL_SUFFIXES):
        try:
            return pa_json.read_json(path).to_pylist()
        except (pa.ArrowException, UnicodeDecodeError):  # pyarrow reads bad UTF-8, to_pylist fails on it
            return _read_jsonl_slowly(path, what)  # locates the bad line, or copes with mixed types
    raise DataError(f"{what} '{path}': unknown file type; valid: {', '.join(PARQUET_SUFFIXES + JSONL_SUFFIXES)}")


def _read_jsonl_slowly(path: str, what: str) -> List[Dict[str, Any]]:
    return [row for _, row in iter_jsonl(path, what)]


def iter_jsonl(path: str, what: str = "data file", on_line=None) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(1-based line number, row) of each non-blank line, one line in memory at a time; a DataError
    names the first line that is not UTF-8, not JSON or not an object. `on_line(n_bytes)` is called
    per line read (a progress bar over the file's bytes)."""
    with open(path, "rb") as f:  # bytes: a non-UTF-8 byte is reported with its line, not as a traceback
        for line_no, raw in enumerate(f, start=1):
            if on_line is not None:
                on_line(len(raw))
            line = _utf8_line(raw, path, line_no, what)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{what} '{path}' line {line_no}: invalid JSON ({e.msg} at column {e.colno}); "
                                "expected one JSON object per line") from e
            if not isinstance(row, dict):
                raise DataError(f"{what} '{path}' line {line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def iter_parquet(path: str, columns: Sequence[str], what: str = "data file",
                 batch_rows: int = 8192) -> Iterator[List[Dict[str, Any]]]:
    """The rows of `columns` (those the file has) in record batches: a large file is never whole in memory."""
    try:
        f = pq.ParquetFile(path)
        present = [c for c in columns if c in f.schema_arrow.names]
        for batch in f.iter_batches(batch_size=batch_rows, columns=present):
            yield batch.to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{what} '{path}': not a readable parquet file ({e})") from e


def _utf8_line(raw: bytes, path: str, line_no: int, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} '{path}' line {line_no}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is "
                        "not UTF-8; JSONL files must be UTF-8 text (re-save the file as UTF-8)") from None


def jsonl_line_numbers(path: str) -> List[int]:
    """1-based line numbers of the non-blank lines: row i of a JSONL file is on line [i]."""
    with open(path, "rb") as f:
        return [n for n, line in enumerate(f, start=1) if line.strip()]


def locate(path: str, row: int, lines: Optional[Sequence[int]] = None) -> str:
    """'file' row N (line L): how every message names a row."""
    return where(path, row, lines[row] if lines is not None and row < len(lines) else None)


def where(path: str, row: int, line: Optional[int] = None) -> str:
    return f"'{path}' row {row}" + (f" (line {line})" if line is not None else "")


def file_labels(paths: Sequence[str]) -> List[str]:
    """The file part of each sample id: the base name, or the path as given when two files share it."""
    names = [os.path.basename(p) for p in paths]
    return [p if names.count(n) > 1 else n for p, n in zip(paths, names)]


# ----------------------------------------------------------------------------------- fields
def _drop_none(d: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def ground_truth_text(value) -> Union[str, None]:
    """The ground truth as text, or None when it is not a string or a number."""
    if isinstance(value, bool):  # a bool is an int in Python, but never a meaningful answer
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return value if isinstance(value, str) else None


def _messages_problem(value) -> Optional[str]:
    if not value:
        return "is an empty list of messages; expected at least one {role, content} message"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"item {i} is {_short(m)}; expected a list of {{role, content}} dicts"
        if m["role"] not in VALID_ROLES:
            return f"item {i} has unknown role {_short(m['role'])}; valid: {', '.join(VALID_ROLES)}"
        if isinstance(m["content"], list):  # content parts (image prompts): text and image parts
            bad = [p for p in m["content"] if not (isinstance(p, dict) and p.get("type") in ("text", "image"))]
            if bad or not m["content"]:
                return (f"item {i} has content parts {_short(m['content'])}; expected a non-empty list of "
                        "{type: text, text: ...} / {type: image} parts")
        elif not isinstance(m["content"], str):
            return f"item {i} has content {_short(m['content'])}; expected text"
    if not any(_content_text(m["content"]).strip() or isinstance(m["content"], list) for m in value):
        return "is empty (every message's content is blank)"
    return None


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def row_problems(row: Dict[str, Any], prompt_key: str, image_key: Optional[str] = None,
                 vision: bool = False) -> List[str]:
    """What is wrong with one row, as 'field ...; expected ...' fragments (empty when valid).
    image_key: the column of a row's images (vision.image_key); vision: the model takes images
    (a text-only model given images is refused, naming the field)."""
    image_problem = image_field_problem(row, image_key, vision)
    p = [image_problem] if image_problem else []
    prompt = row.get(prompt_key)
    if prompt is None:
        p.append(f"field '{prompt_key}' (data.prompt_key) is missing; expected text or a list of "
                 "{role, content} messages")
    elif isinstance(prompt, str):
        if not prompt.strip():
            p.append(f"field '{prompt_key}' is empty; expected the prompt text")
    elif isinstance(prompt, list):
        problem = _messages_problem(prompt)
        if problem:
            p.append(f"field '{prompt_key}' {problem}")
    else:
        p.append(f"field '{prompt_key}' is {type(prompt).__name__} {_short(prompt)}; expected text or a "
                 "list of {role, content} messages")
    source = row.get("data_source")
    if not isinstance(source, str) or not source.strip():
        got = "missing" if source is None else f"{_short(source)}"
        p.append(f"field 'data_source' is {got}; expected a non-empty name such as 'gsm8k' (it picks the "
                 "reward function)")
    truth = row.get("ground_truth")
    if truth is None:
        p.append("field 'ground_truth' is missing; expected the reference answer as text or a number")
    elif ground_truth_text(truth) is None:
        p.append(f"field 'ground_truth' is {type(truth).__name__} {_short(truth)}; expected text or a number")
    elif not ground_truth_text(truth).strip():
        p.append("field 'ground_truth' is empty; expected the reference answer")
    extra = row.get("extra")
    if extra is not None and not isinstance(extra, dict):
        p.append(f"field 'extra' is {type(extra).__name__} {_short(extra)}; expected a dict (or no field)")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, str) and t for t in tools)):
        p.append(f"field 'tools' is {_short(tools)}; expected a list of tool names (multi_turn), or no field")
    return p


def image_field_problem(row: Dict[str, Any], image_key: Optional[str], vision: bool) -> Optional[str]:
    """What is wrong with a row's images field (not a list; images for a text-only model), or None.
    The images themselves are checked where they are decoded (verl_hpc.data.images)."""
    images = row.get(image_key) if image_key else None
    if images is None or (isinstance(images, (list, tuple)) and not images):  # [] = no images
        return None
    if not isinstance(images, (list, tuple)):
        return (f"field '{image_key}' (vision.image_key) is {type(images).__name__}; expected a list of "
                "images (bytes, paths or {bytes, path} dicts)")
    if not vision:
        return (f"field '{image_key}' holds {len(images)} image(s) but the model is text-only (its "
                "config.json has no vision_config); use a vision-language model, or drop the field")
    return None


def sft_row_problem(row: Dict[str, Any], keys: Sequence[str]) -> Optional[str]:
    """What is wrong with one SFT row (prompt and response keys), or None."""
    for key in keys:
        if row.get(key) in (None, "", []):
            return f"field '{key}' is missing or empty"
    return None


def to_record(row: Dict[str, Any], record_id: str, prompt_key: str, image_key: Optional[str] = None,
              base_dir: str = "") -> PromptRecord:
    """A validated row (row_problems(row) == []) as a PromptRecord."""
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        prompt = [{"role": m["role"], "content": _parts(m["content"])} for m in prompt]
    images = row.get(image_key) if image_key else None
    return PromptRecord(id=record_id, prompt=prompt, data_source=row["data_source"],
                        ground_truth=ground_truth_text(row["ground_truth"]),
                        extra=_with_tools(_drop_none(row.get("extra") or {}), row.get("tools")),
                        images=list(images) if images else None, base_dir=base_dir)


def _parts(content):
    """Message content as given, content parts without the None keys Arrow fills in."""
    return content if isinstance(content, str) else [_drop_none(p) for p in content]


def _with_tools(extra: Dict[str, Any], tools: Optional[List[str]]) -> Dict[str, Any]:
    """A row's `tools` (the tools its episodes are offered, multi_turn) travel in its extra, as
    extra["tools"], so they reach the rollout with the prompt; a row without the field is offered
    multi_turn.tools."""
    return {**extra, "tools": list(tools)} if tools is not None else extra


def load_records(paths: Sequence[str], prompt_key: str, what: str = "data.train_files",
                 image_key: Optional[str] = None, vision: bool = False) -> List[PromptRecord]:
    """Every row of every file as PromptRecords, or one DataError listing the bad rows.
    image_key, vision: see row_problems."""
    paths = [str(p) for p in paths]  # also takes an OmegaConf ListConfig
    records: List[PromptRecord] = []
    problems: List[str] = []
    total = 0
    for path, label in zip(paths, file_labels(paths)):  # ids stay unique across files
        rows = read_rows(path, what=f"{what} file")
        if not rows:
            problems.append(f"{what} file '{path}': no rows")
            total += 1
            continue
        lines = None
        for i, row in enumerate(rows):
            found = row_problems(row, prompt_key, image_key, vision)
            if found:
                if lines is None and path.lower().endswith(JSONL_SUFFIXES):
                    lines = jsonl_line_numbers(path)
                total += len(found)
                problems.extend(f"{locate(path, i, lines)}: {msg}" for msg in found)
            elif not problems:  # once anything failed, only the problems are still wanted
                records.append(to_record(row, f"{label}:{i}", prompt_key, image_key,
                                         os.path.dirname(os.path.abspath(path))))
    if problems:
        raise DataError.from_problems(problems, total)
    return records
