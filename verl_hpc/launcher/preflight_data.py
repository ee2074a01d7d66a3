"""Before the queue: every row of every data file, streamed, judged by the job's own rules.

The job reads its data sets on rank 0 after the queue; a bad row 40 would end it there. Here each
file is read row by row (JSONL a line at a time, parquet a record batch at a time, so a large file
is never whole in memory) and every row goes through what the job runs on it, with the job's words:
verl_hpc.data.records (UTF-8, JSON object, row_problems: prompt text or chat messages, data_source,
ground_truth, extra), the reward registry's routing of data_source and its ground-truth checks
(as RewardScorer.check_samples: none with reward.custom_function, unknown sources allowed with a
reward model), a teacher for each training row's data_source (teacher.by_data_source, as
Teachers.check_sources), and, with the tokenizer, the chat template and data.overlong_prompts
(verl_hpc.data.filtering: overlong rows under `error`, every row overlong under either), and a row's
images through the model's own processor (preflight_images.py). A file
over LARGE_BYTES or LARGE_ROWS shows a progress bar on stderr. Each file or set gives at most one
line per kind of problem: its first row at fault and how many more there are.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from verl_hpc.data.errors import DataError

LARGE_BYTES = 50 * 2**20
LARGE_ROWS = 100_000
TOKENIZE_CHUNK = 1024  # prompts per batched tokenizer call


@dataclass
class DataSet:
    """The files one PromptDataset of the job is loaded from (filtered together)."""

    field: str  # data.train_files, data.tasks.<name>.val_files, data.sft_files
    paths: List[str]
    train: bool = False  # counts towards data.train_batch_size
    data_source: str = ""  # a task's data_source, which replaces the rows' own for the reward


@dataclass
class _Found:
    """Problems of one file or set: the first line of each kind and how many there were."""

    lines: List[str] = field(default_factory=list)
    counts: List[int] = field(default_factory=list)
    kinds: List[str] = field(default_factory=list)

    def add(self, line: str, kind: str = "") -> None:
        """Keep the first line of each kind (a bad row, an unknown source 'x', ...), count the others."""
        if kind and kind in self.kinds:
            self.counts[self.kinds.index(kind)] += 1
            return
        self.lines.append(line)
        self.counts.append(1)
        self.kinds.append(kind)

    def summary(self, where: str) -> List[str]:
        return [line + (f" (and {n - 1} more in {where})" if n > 1 else "") for line, n in zip(self.lines, self.counts)]


def data_sets(cfg) -> List[DataSet]:
    d, job = cfg.data, cfg.trainer.job
    if job == "sft":
        return [DataSet("data.sft_files", [str(p) for p in d.sft_files])]
    if job != "rl":
        return []
    if not d.tasks:
        sets = [DataSet("data.train_files", [str(p) for p in d.train_files], train=True)]
        return sets + ([DataSet("data.val_files", [str(p) for p in d.val_files])] if d.val_files else [])
    from verl_hpc.config.sections.tasks import task_specs

    return [DataSet(f"data.tasks.{name}.{split}_files", [str(p) for p in getattr(t, f"{split}_files")],
                    train=split == "train", data_source=t.data_source)
            for name, t in task_specs(d).items() for split in ("train", "val") if getattr(t, f"{split}_files")]


def data_problems(cfg, tokenizer=None) -> List[str]:
    """One line per problem in the data sets of the job, then the batch size against the train rows."""
    problems, train_rows, counted = [], 0, True
    images = None
    if cfg.trainer.job == "rl" and data_sets(cfg):
        from verl_hpc.launcher.preflight_images import RowImages

        images = RowImages(cfg)
        problems += [images.problem] if images.problem else []
    for s in data_sets(cfg):
        check = SetCheck(cfg, s, tokenizer, images)
        found, kept = check.run()
        problems += found
        if s.train:
            train_rows, counted = train_rows + kept, counted and not found
        if s.train and not found and cfg.data.mixture:  # the sampler's own check, on the rows it would get
            from verl_hpc.data.sampler import mixture_problems

            problems += mixture_problems(check.kept_sources(), cfg.data.mixture)
    if counted and cfg.trainer.job == "rl" and train_rows < cfg.data.train_batch_size:
        after = " after data.overlong_prompts' filter" if tokenizer is not None else ""
        problems.append(f"data.train_batch_size: {cfg.data.train_batch_size} prompts per step, but the train set "
                        f"has {train_rows} prompt(s){after}; the sampler would draw some prompts twice in one step "
                        f"(it runs on into the next epoch, no drop_last); valid: at most {train_rows}, or more data")
    return problems


def data_file_problem(path: str, needed) -> str:
    """'' or what is wrong with one data file as a whole (exists, a known type, a parquet footer with
    the needed columns); its rows are checked by preflight_data.py."""
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
        return ""  # its rows are read one by one (preflight_data.py)
    return f"'{path}': unknown file type; valid: {', '.join(PARQUET_SUFFIXES + JSONL_SUFFIXES)}"


class SetCheck:
    """Every row of one DataSet: row checks, reward routing, prompt lengths."""

    def __init__(self, cfg, data_set: DataSet, tokenizer=None, images=None):
        self.cfg, self.s = cfg, data_set
        self.rl = cfg.trainer.job == "rl"
        self.tokenizer = tokenizer if self.rl else None  # SFT's length rule drops silently: nothing to refuse
        self.ids: List[str] = []
        self.lengths: List[int] = []
        self.pending: List[Tuple[str, object]] = []  # (sample id, prompt) not yet tokenized
        self.set_found = _Found()
        self.images = images if self.rl else None  # RowImages (preflight_images.py): the rows' images
        self.rows_ok = 0
        self.kept = 0  # rows left after the length filter
        # data.mixture: each good row's data_source, in the order of self.ids once tokenized, and
        # the rows the length filter keeps (indices; None: no filter ran)
        self.sources: List[str] = []
        self.kept_rows: Optional[List[int]] = None

    @property
    def needed(self) -> Tuple[str, ...]:
        d = self.cfg.data
        return (d.prompt_key, "data_source", "ground_truth") if self.rl else (d.prompt_key, d.response_key)

    def run(self) -> Tuple[List[str], int]:
        """(problem lines, rows the job would keep)."""
        from verl_hpc.data.records import file_labels

        problems: List[str] = []
        for path, label in zip(self.s.paths, file_labels(self.s.paths)):
            problems += self._file(path, label)
        if problems or self.set_found.lines:
            return problems + self.set_found.summary(self.s.field), 0
        self._tokenize()
        if self.tokenizer is None or self.set_found.lines:
            return self.set_found.summary(self.s.field), self.rows_ok
        overlong = self._overlong()
        return overlong, self.kept

    # -------------------------------------------------------------------------- one file
    def _file(self, path: str, label: str) -> List[str]:
        problem = data_file_problem(path, self.needed)
        if problem:
            return [f"{self.s.field}: {problem}"]
        found, rows = _Found(), 0
        try:
            for i, line, row in self._rows(path):
                rows += 1
                self._row(found, path, label, i, line, row)
        except DataError as e:  # the job's words: "data.train_files file '...' line N: ..."
            return found.summary(f"'{path}'") + [str(e)]
        if not rows:
            return [f"{self.s.field} file '{path}': no rows"]
        return found.summary(f"'{path}'")

    def _rows(self, path: str) -> Iterator[Tuple[int, Optional[int], dict]]:
        from verl_hpc.data.records import PARQUET_SUFFIXES, iter_jsonl, iter_parquet

        what = f"{self.s.field} file"
        with _progress(path, self.tokenizer is not None) as bar:
            if path.lower().endswith(PARQUET_SUFFIXES):
                i = 0
                images = (self.images.key,) if self.images is not None else ()
                # a batch of image rows holds their encoded images: fewer rows per batch then
                for batch in iter_parquet(path, self.needed + ("extra", "tools") + images, what,
                                          batch_rows=64 if images else 8192):
                    for row in batch:
                        yield i, None, row
                        i += 1
                    bar.update(len(batch))
            else:
                for i, (line, row) in enumerate(iter_jsonl(path, what, on_line=bar.update)):
                    yield i, line, row

    def _row(self, found: _Found, path: str, label: str, i: int, line: Optional[int], row: dict) -> None:
        from verl_hpc.data.records import row_problems, sft_row_problem, to_record, where

        key, vision = (self.images.key, self.images.vision) if self.images is not None else (None, False)
        problems = row_problems(row, self.cfg.data.prompt_key, key, vision) if self.rl else \
            [p for p in [sft_row_problem(row, self.needed)] if p]
        if problems:
            found.add(f"{self.s.field}: {where(path, i, line)}: {problems[0]}", "row")
            return
        image = self.images.problem_of(row, self.cfg.data.prompt_key, path, f"row {i}") if self.images else None
        if image:
            found.add(f"{self.s.field}: {where(path, i, line)}: {image}", "image")
            return
        unknown = self._unknown_tools(row)
        if unknown:
            found.add(f"{self.s.field}: {where(path, i, line)}: {unknown}", "tools")
            return
        self.rows_ok += 1
        if self.rl and self.s.train and self.cfg.data.mixture:
            self.sources.append(row["data_source"])
        if self.rl:
            self._reward(found, where(path, i, line), row)
            self._teacher(found, where(path, i, line), row)
            if self.tokenizer is not None:
                sample = f"{label}:{i}"  # the job's sample id
                self.pending.append((sample, to_record(row, sample, self.cfg.data.prompt_key).prompt))
                if len(self.pending) >= TOKENIZE_CHUNK:
                    self._tokenize()

    def _unknown_tools(self, row: dict) -> str:
        """multi_turn: a row's `tools` naming a tool the job does not offer (the job refuses it at
        load, verl_hpc/data/dataset.py); the names come from the config, no user code imported."""
        if not (self.rl and self.cfg.multi_turn.enable and row.get("tools")) or self.cfg.multi_turn.environment:
            return ""
        from verl_hpc.rollout.episodes.build import offered_tools

        valid = offered_tools(self.cfg.multi_turn)
        unknown = [n for n in row["tools"] if n not in valid]
        return (f"field 'tools' names {', '.join(map(repr, unknown))}, not a tool of this job; valid: "
                f"{', '.join(valid)}") if unknown else ""

    def _teacher(self, found: _Found, at: str, row: dict) -> None:
        """Several teachers (teacher.by_data_source, no teacher.model_path): a training row whose
        source no teacher scores (the colocated job refuses it at start, a split job's training
        ranks only at the step that draws it)."""
        t = self.cfg.teacher
        if not (t.enable and self.s.train) or t.model_path:
            return
        source = self.s.data_source or row["data_source"]
        if not t.folder_of(source):
            found.add(f"{self.s.field}: {at}: teacher.by_data_source has no teacher for data_source {source!r} "
                      f"(listed: {', '.join(sorted(t.by_data_source))}) and teacher.model_path is empty; add it or "
                      "set teacher.model_path as the teacher of the rest", f"teacher {source}")

    def _reward(self, found: _Found, at: str, row: dict) -> None:
        """The job's RewardScorer.check_samples for one row, with its words."""
        from verl_hpc.data.records import ground_truth_text
        from verl_hpc.rewards import registry

        r = self.cfg.reward
        if r.custom_function or self.cfg.agent.enable:
            return  # the user's function decides what it accepts; agent runs return their own rewards
        source = self.s.data_source or row["data_source"]
        rule = registry.resolve(source)
        if rule is None:
            if not r.reward_model.enable:
                found.add(f"{self.s.field}: {at}: {registry.unknown_source_message(source)}", f"source {source}")
            return
        problem = rule.check(ground_truth_text(row["ground_truth"])) if rule.check is not None else None
        if problem:
            found.add(f"{self.s.field}: {at} (data_source {source!r}): field {problem}", "ground_truth")

    def kept_sources(self) -> List[str]:
        """The data_source of every row the job keeps (data.mixture's sampler groups them by it)."""
        return self.sources if self.kept_rows is None else [self.sources[i] for i in self.kept_rows]

    # -------------------------------------------------------------------------- lengths
    def _tokenize(self) -> None:
        from verl_hpc.data.templates import encode_prompts

        if not self.pending or self.set_found.lines:
            self.pending = []
            return
        ids, prompts = zip(*self.pending)
        self.pending = []
        try:
            _, token_ids = encode_prompts(self.tokenizer, prompts, self.cfg.data.wrap_plain_text, ids)
        except DataError as e:  # a chat template that cannot render a prompt: the job's words
            self.set_found.add(f"{self.s.field}: {e}")
            return
        self.ids += ids
        self.lengths += [len(x) for x in token_ids]

    def _overlong(self) -> List[str]:
        from verl_hpc.data.filtering import filter_overlong

        d = self.cfg.data
        try:
            kept, dropped = filter_overlong(self.ids, self.lengths, d.max_prompt_length, d.overlong_prompts,
                                            self.s.field, log_drops=False)
        except DataError as e:
            self.kept = 0
            more = f" (and {len(e.problems) - 1} more prompts over it)" if len(e.problems) > 1 else ""
            return [e.problems[0] + more]
        self.kept, self.kept_rows = len(kept), kept
        if dropped:  # not an error: said once here, so that the job's own warning is no surprise
            print(f"[submit] {self.s.field}: the job will drop {dropped} of {len(self.lengths)} prompts longer "
                  f"than data.max_prompt_length = {d.max_prompt_length} tokens (longest: {max(self.lengths)})",
                  flush=True)
        return []


def _progress(path: str, tokenizing: bool):
    """A tqdm bar on stderr for a large file (rows of a parquet file, bytes of a JSONL file)."""
    from tqdm import tqdm

    from verl_hpc.data.records import PARQUET_SUFFIXES

    size = Path(path).stat().st_size
    parquet = path.lower().endswith(PARQUET_SUFFIXES)
    total = _parquet_rows(path) if parquet else size
    large = size > LARGE_BYTES or (parquet and total > LARGE_ROWS)
    what = "every row, tokenizing the prompts" if tokenizing else "every row"
    return tqdm(total=total, unit="rows" if parquet else "B", unit_scale=not parquet, file=sys.stderr,
                desc=f"[submit] checking {Path(path).name} ({what})", disable=not large, mininterval=2.0)


def _parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - the row reader reports an unreadable file in the job's words
        return 0
