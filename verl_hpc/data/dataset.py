"""PromptDataset: records + rendered prompts + token ids, after the length filter.

Everything is tokenised once at load time: the length filter needs every prompt's length anyway,
and a step then only indexes lists. (GSM8K's 7.5k and MATH's 12k prompts take about a second.)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from verl_hpc.data.batch import PromptBatch
from verl_hpc.data.errors import DataError
from verl_hpc.data.filtering import filter_overlong
from verl_hpc.data.processor import ImagePrompts
from verl_hpc.data.records import PromptRecord, load_records
from verl_hpc.data.templates import encode_prompts


def _encode_with_images(records: Sequence[PromptRecord], vision: ImagePrompts):
    """Texts and token ids (image tokens expanded) of image prompts; every bad row in one DataError."""
    texts, ids, problems = [], [], []
    for r in records:
        try:
            text, tokens, _ = vision.prompt(r)
        except DataError as e:  # it names the image or the template's failure; the row is named here
            problems.append(f"sample {r.id}: {e}")
            continue
        texts.append(text)
        ids.append(tokens)
    if problems:
        raise DataError.from_problems(problems)
    return texts, ids


def offered_schemas(record: PromptRecord, tools: Mapping[str, dict]) -> List[dict]:
    """The schemas of the tools `record` is offered: its `tools` field, else every tool."""
    names = record.extra.get("tools") or list(tools)
    unknown = [n for n in names if n not in tools]
    if unknown:
        raise DataError(f"sample {record.id}: field 'tools' names {', '.join(map(repr, unknown))}, not a tool "
                        f"of this job; valid: {', '.join(tools) or 'none (multi_turn offers no tools)'}")
    return [tools[n] for n in names]


@dataclass
class PromptDataset:
    records: List[PromptRecord]
    texts: List[str]
    token_ids: List[List[int]]
    n_dropped: int = 0  # prompts removed by the length filter
    # a vision-language model's image prompts: a batch's images are decoded and processed again
    # when the batch is drawn (holding every row's pixel values would not fit a real data set)
    vision: Optional[ImagePrompts] = None

    @classmethod
    def load(cls, paths: Sequence[str], tokenizer, prompt_key: str, max_prompt_length: int,
             overlong_prompts: str, wrap_plain_text: bool,
             what: str = "data.train_files", tools: Optional[Mapping[str, dict]] = None,
             images: Optional[ImagePrompts] = None) -> "PromptDataset":
        """tools: {name: schema} of a multi_turn job's tools; each row's prompt lists the ones it is
        offered (its `tools` field, else all), and a row naming another is a DataError.
        images: where rows keep images and the model's processor (ImagePrompts); without it, or
        with a text-only model, a row holding images is a DataError."""
        if not paths:
            raise DataError(f"{what}: empty; expected at least one .parquet or .jsonl file")
        vision = images if images is not None and images.processor is not None else None
        records = load_records(paths, prompt_key, what=what, image_key=images.image_key if images else None,
                               vision=vision is not None)
        if vision is not None:
            if tools is not None:
                raise DataError(f"{what}: multi_turn with a vision-language model is not supported: the episode "
                                "code renders text turns only and has no way to return an image observation")
            texts, ids = _encode_with_images(records, vision)
        else:
            offered = [offered_schemas(r, tools) for r in records] if tools is not None else None
            texts, ids = encode_prompts(tokenizer, [r.prompt for r in records], wrap_plain_text,
                                        [r.id for r in records], offered)
        kept, dropped = filter_overlong([r.id for r in records], [len(x) for x in ids], max_prompt_length,
                                        overlong_prompts, what=what)
        return cls([records[i] for i in kept], [texts[i] for i in kept], [ids[i] for i in kept], dropped,
                   vision)

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        recs = [self.records[i] for i in indices]
        media = [self.vision.prompt(r)[2] for r in recs] if self.vision is not None else []
        return PromptBatch(ids=[r.id for r in recs], prompt_ids=[list(self.token_ids[i]) for i in indices],
                           prompt_texts=[self.texts[i] for i in indices],
                           data_sources=[r.data_source for r in recs],
                           ground_truths=[r.ground_truth for r in recs], extras=[dict(r.extra) for r in recs],
                           media=media)

    @classmethod
    def concat(cls, parts: Sequence["PromptDataset"]) -> "PromptDataset":
        """One dataset holding the rows of `parts` in order (data.tasks: one part per task)."""
        visions = [p.vision for p in parts if p.vision is not None]
        return cls([r for p in parts for r in p.records], [t for p in parts for t in p.texts],
                   [x for p in parts for x in p.token_ids], sum(p.n_dropped for p in parts),
                   visions[0] if visions else None)

    def indices_by_task(self) -> Dict[str, List[int]]:
        """{task: row indices} (rows tagged by verl_hpc.data.tasks; untagged rows under '')."""
        groups: Dict[str, List[int]] = {}
        for i, r in enumerate(self.records):
            groups.setdefault(str(r.extra.get("task", "")), []).append(i)
        return groups

    def indices_by_source(self) -> Dict[str, List[int]]:
        groups: Dict[str, List[int]] = {}
        for i, r in enumerate(self.records):
            groups.setdefault(r.data_source, []).append(i)
        return groups

    def fingerprint(self) -> str:
        """A short digest of the sample ids in order: a resumed sampler checks it indexes the same rows."""
        digest = hashlib.sha1("\n".join(r.id for r in self.records).encode()).hexdigest()[:16]
        return f"{len(self.records)}:{digest}"
