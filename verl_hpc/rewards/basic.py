"""The simplest scorers: exact match, and the synthetic arithmetic task of the CPU demo."""
from __future__ import annotations

import re
from typing import Optional

_LEADING_INT = re.compile(r"^\s*(-?\d+)")


def exact_match_score(solution_str: str, ground_truth: str, extra=None) -> float:
    """1.0 when the response equals the reference after stripping surrounding whitespace."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def synthetic_arith_score(solution_str: str, ground_truth: str, extra=None) -> float:
    """1.0 when the response starts with the right integer and the integer ends there.

    The demo's tiny model answers in one or two tokens and then should stop; what follows a
    complete answer (EOS is usually stripped by decoding, but a model may ramble on before it has
    learnt to stop) is not judged, so the reward is about the arithmetic. "7" and "7 and more" are
    right for 7, "77" is not: the integer must be the whole leading number.
    """
    m = _LEADING_INT.match(solution_str)
    return 1.0 if m is not None and int(m.group(1)) == int(ground_truth) else 0.0


def check_integer_ground_truth(ground_truth: str) -> Optional[str]:
    if not re.fullmatch(r"\s*-?\d+\s*", str(ground_truth)):
        return (f"ground_truth {ground_truth!r} is not an integer; expected e.g. '7' "
                "(synthetic_arith answers are integers)")
    return None


def check_nonempty_ground_truth(ground_truth: str) -> Optional[str]:
    return None if str(ground_truth).strip() else "ground_truth is empty; expected the exact reference text"
