"""GSM8K: the final number of a solution, compared numerically with the reference.

Two extraction modes, as commonly reported for GSM8K:
- strict: the number after the last '####' (the format the prompt asks for, and the one the
  dataset's reference solutions end with). A right number anywhere else earns nothing, which is
  what teaches the model the answer format.
- flexible: the last number anywhere in the text, for models that were never asked for '####'.

Numbers compare as exact fractions after removing thousands separators and '$', so "1,200",
"$1200" and "1200.00" all equal a ground truth of "1200". Only well-formed thousands groups count
as one number: in "3,4" there are two numbers, 3 and 4.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

# a minus sign is a sign only where it cannot be subtraction (not after a word character or ')')
_NUMBER = r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)
METHODS = ("strict", "flexible")


def extract_strict(text: str) -> Optional[str]:
    found = _STRICT.findall(text)
    return found[-1] if found else None


def extract_flexible(text: str) -> Optional[str]:
    found = _ANY_NUMBER.findall(text)
    return found[-1] if found else None


def parse_number(text: str) -> Optional[Fraction]:
    """'1,200' / '$1200' / '-3.50' / '7/2' as an exact Fraction; None when it is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    cleaned = cleaned.rstrip(".")  # "... is 12." ends a sentence, not a decimal
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str, b: str) -> bool:
    x, y = parse_number(a), parse_number(b)
    return x is not None and x == y


def gsm8k_score(solution_str: str, ground_truth: str, extra=None, method: str = "strict") -> float:
    if method not in METHODS:
        raise ValueError(f"gsm8k extraction method {method!r}; valid: {', '.join(METHODS)}")
    answer = extract_strict(solution_str) if method == "strict" else extract_flexible(solution_str)
    return 1.0 if answer is not None and numbers_equal(answer, ground_truth) else 0.0


def check_ground_truth(ground_truth: str) -> Optional[str]:
    """A problem with a gsm8k ground truth (it must be a number), or None."""
    if parse_number(ground_truth) is None:
        return (f"ground_truth {ground_truth!r} is not a number; expected e.g. '72' or '1,200' "
                "(gsm8k answers are numbers)")
    return None
