"""The simplest scorers: exact match, the synthetic arithmetic task of the CPU demo, and the
one-word answers of the VLM demo's visual task."""
from __future__ import annotations

import re
from typing import Optional

_LEADING_INT = re.compile(r"^\s*(-?\d+)")
_EDGE_PUNCTUATION = re.compile(r"^[\W_]+|[\W_]+$")  # anything but letters and digits, at either end


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


def first_word(text: str) -> str:
    """The first whitespace-separated word, lower-cased, without punctuation at its ends:
    "Red." -> "red", "**3**, I think" -> "3", "left-hand" -> "left-hand"."""
    words = str(text).split(maxsplit=1)
    return _EDGE_PUNCTUATION.sub("", words[0]).lower() if words else ""


def first_word_score(solution_str: str, ground_truth: str, extra=None) -> float:
    """1.0 when the response's first word is the one-word answer, case and punctuation aside.

    The visual task (verl_hpc/data/prepare/visual.py) answers "3", "red", "left"; as with the
    arithmetic task, what follows the answer is not judged, but the answer must be the first word
    and all of it: "33" is not "3", "reddish" is not "red", "The answer is red" scores 0.
    """
    answer = first_word(solution_str)
    return 1.0 if answer and answer == first_word(ground_truth) else 0.0


def check_word_ground_truth(ground_truth: str) -> Optional[str]:
    words = str(ground_truth).split()
    if len(words) != 1 or not first_word(words[0]):
        return (f"ground_truth {ground_truth!r} is not one word; expected e.g. '3', 'red' or 'left' "
                "(the visual task's answers are one word or number)")
    return None


def check_integer_ground_truth(ground_truth: str) -> Optional[str]:
    if not re.fullmatch(r"\s*-?\d+\s*", str(ground_truth)):
        return (f"ground_truth {ground_truth!r} is not an integer; expected e.g. '7' "
                "(synthetic_arith answers are integers)")
    return None


def check_nonempty_ground_truth(ground_truth: str) -> Optional[str]:
    return None if str(ground_truth).strip() else "ground_truth is empty; expected the exact reference text"
