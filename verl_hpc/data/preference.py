"""Offline preference data for `trainer.job: dpo`: parquet / JSONL rows, one per example.

    paired  (preference.loss dpo | ipo | simpo | orpo):  prompt, chosen, rejected
    unpaired (preference.loss kto):                      prompt, completion, label (bool: desirable)

Column names come from data.prompt_key / data.chosen_key / data.rejected_key (KTO:
data.completion_key, data.label_key). Prompts are rendered with the chat template
exactly as for RL and SFT (verl_hpc.data.templates); responses get EOS appended, as in SFT. A bad
row (missing or empty field, a label that is not a boolean, chosen == rejected) raises a DataError
naming the file and the row; rows longer than max_prompt_length + max_response_length are dropped
and counted.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Sequence

from verl_hpc.data.errors import DataError

PAIRED_LOSSES = ("dpo", "ipo", "simpo", "orpo")


@dataclasses.dataclass
class PreferenceExample:
    """Token ids; for a paired example `rejected` is set, for KTO `desirable` is."""

    prompt: List[int]
    chosen: List[int]  # paired: the preferred response; KTO: the completion
    rejected: List[int] = dataclasses.field(default_factory=list)
    desirable: bool = True
    source: str = ""  # "file:row", for messages


def _label(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise DataError(f"{where}: label must be a boolean (true = desirable); got {value!r}")


def load_preference_examples(paths: Sequence[str], tokenizer, loss: str, *, prompt_key: str,
                             chosen_key: str, rejected_key: str, completion_key: str, label_key: str,
                             wrap_plain_text: bool, max_length: int = 0, what: str = "data.preference_files"
                             ) -> List[PreferenceExample]:
    from verl_hpc.data import encode_prompts, read_rows

    if not paths:
        raise DataError(f"{what}: empty; trainer.job=dpo needs preference data files")
    paired = loss in PAIRED_LOSSES
    fields = (prompt_key, chosen_key, rejected_key) if paired else (prompt_key, completion_key, label_key)
    eos = tokenizer.eos_token_id
    out: List[PreferenceExample] = []
    for path in paths:
        rows = read_rows(path, what=what)
        name = Path(path).name
        for i, row in enumerate(rows):
            where = f"{what} '{path}' row {i}"
            for key in fields:
                if row.get(key) is None or (key != label_key and row.get(key) in ("", [])):
                    raise DataError(f"{where}: field '{key}' is missing or empty (preference.loss={loss} "
                                    f"needs {', '.join(fields)})")
            if paired and str(row[chosen_key]) == str(row[rejected_key]):
                raise DataError(f"{where}: '{chosen_key}' and '{rejected_key}' are the same text")
        _, prompts = encode_prompts(tokenizer, [r[prompt_key] for r in rows], wrap_plain_text,
                                    [f"{name}:{i}" for i in range(len(rows))])
        enc = lambda key: [list(t) + ([eos] if eos is not None else [])  # noqa: E731
                           for t in tokenizer([str(r[key]) for r in rows], add_special_tokens=False)["input_ids"]]
        if paired:
            chosen, rejected = enc(chosen_key), enc(rejected_key)
            labels = [True] * len(rows)
        else:
            chosen, rejected = enc(completion_key), [[] for _ in rows]
            labels = [_label(r[label_key], f"{what} '{path}' row {i}") for i, r in enumerate(rows)]
        for i, p in enumerate(prompts):
            longest = max(len(chosen[i]), len(rejected[i]))
            if max_length and len(p) + longest > max_length:
                continue
            out.append(PreferenceExample(list(p), chosen[i], rejected[i], labels[i], f"{name}:{i}"))
    return out
