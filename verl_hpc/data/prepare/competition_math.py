"""MATH (Hendrycks et al.; JSONL: `problem`, `solution` containing `\\boxed{...}`) -> prompt parquet.

The ground truth is the content of the solution's last \\boxed{} (or \\fbox{}), nested braces kept
verbatim; normalisation happens at scoring time on both sides, so the stored answer stays readable.
`level` and `type`, when present, are kept in extra for per-level metrics.
"""
from __future__ import annotations

from typing import Dict, List

from verl_hpc.data.errors import DataError
from verl_hpc.data.records import JSONL_SUFFIXES, jsonl_line_numbers, locate, read_rows
from verl_hpc.rewards.math_answer import last_boxed

DATA_SOURCE = "math"
INSTRUCTION = "Reason step by step and put the final answer in \\boxed{}."


def math_rows(in_path: str, instruction: str = INSTRUCTION) -> List[Dict]:
    rows = read_rows(in_path, what="math input")
    out, problems = [], []
    for i, row in enumerate(rows):
        problem, solution = row.get("problem"), row.get("solution")
        boxed = last_boxed(solution) if isinstance(solution, str) else None
        if not isinstance(problem, str) or not problem.strip():
            problems.append((i, "field 'problem' is missing or empty; expected the problem text"))
        elif boxed is None or not boxed.strip():
            problems.append((i, "field 'solution' has no complete \\boxed{...} answer; expected a MATH solution"))
        else:
            extra = {"index": i, "reference_solution": solution}
            extra.update({k: str(row[k]) for k in ("level", "type") if row.get(k) is not None})
            out.append({"data_source": DATA_SOURCE, "prompt": f"{problem.strip()}\n\n{instruction}",
                        "ground_truth": boxed.strip(), "extra": extra})
    if problems:
        lines = jsonl_line_numbers(in_path) if in_path.lower().endswith(JSONL_SUFFIXES) else None
        raise DataError.from_problems([f"{locate(in_path, i, lines)}: {msg}" for i, msg in problems])
    return out
