"""GSM8K (public JSONL: `question`, `answer` whose last line is `#### <number>`) -> prompt parquet.

The prompt is the question followed by an instruction to give the final answer after '####', the
format the gsm8k strict scorer reads; the ground truth is the number after '####' with thousands
separators removed. The reference solution is kept in extra['reference_solution'] (scoring it must
give 1.0, which the tests check).
"""
from __future__ import annotations

from typing import Dict, List

from verl_hpc.data.errors import DataError
from verl_hpc.data.records import JSONL_SUFFIXES, jsonl_line_numbers, locate, read_rows
from verl_hpc.rewards.gsm8k import extract_strict

DATA_SOURCE = "gsm8k"
INSTRUCTION = 'Think step by step, then write the final answer as a number after "####".'


def gsm8k_rows(in_path: str, instruction: str = INSTRUCTION) -> List[Dict]:
    rows = read_rows(in_path, what="gsm8k input")
    out, problems = [], []
    for i, row in enumerate(rows):
        question, answer = row.get("question"), row.get("answer")
        final = extract_strict(answer) if isinstance(answer, str) else None
        if not isinstance(question, str) or not question.strip():
            problems.append((i, "field 'question' is missing or empty; expected the problem text"))
        elif final is None:
            problems.append((i, "field 'answer' has no final '#### <number>'; expected the GSM8K solution format"))
        else:
            out.append({"data_source": DATA_SOURCE, "prompt": f"{question.strip()} {instruction}",
                        "ground_truth": final.replace(",", ""),
                        "extra": {"index": i, "reference_solution": answer}})
    if problems:
        lines = jsonl_line_numbers(in_path) if in_path.lower().endswith(JSONL_SUFFIXES) else None
        raise DataError.from_problems([f"{locate(in_path, i, lines)}: {msg}" for i, msg in problems])
    return out
