"""MATH-style answers: the last \\boxed{...} of a solution, normalised, compared with the reference.

Extraction takes the last `\\boxed{...}` or `\\fbox{...}` (a solution may box intermediate results;
the final answer comes last), matching braces so `\\boxed{\\frac{1}{2}}` yields `\\frac{1}{2}`.

Normalisation removes notation that does not change the answer, so that the comparison is a string
equality: spacing commands (`\\!`, `\\,`, ...), `\\left`/`\\right`, `\\displaystyle`, dollar signs and
`\\$`, percent signs, degrees (`^\\circ`), a trailing unit in `\\text{...}`/`\\mbox{...}`, a trailing
period, all whitespace; `\\dfrac`/`\\tfrac` become `\\frac`, `\\frac12` becomes `\\frac{1}{2}`, `a/b` of
two integers becomes `\\frac{a}{b}`, `.5` becomes `0.5`, `x = 5` becomes `5`, `1,000` becomes `1000`.
Answers that are simple numbers (integers, decimals, fractions of integers) then also compare by
value, so `0.5`, `\\frac{1}{2}`, `1/2` and `\\frac{2}{4}` are all equal.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} / \\fbox{...} (nested braces handled), or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox")
    if i < len(text) and text[i] == " " and not text[i:].lstrip().startswith("{"):
        # "\boxed 5": the argument runs to the next dollar sign or the end
        return text[i + 1:].split("$")[0].strip() or None
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the model stopped mid-answer


_REMOVE = [r"\\!", r"\\,", r"\\;", r"\\:", r"\\ ", r"\\displaystyle", r"\\left(?![a-zA-Z])", r"\\right(?![a-zA-Z])",
           r"\^\s*\{\s*\\circ\s*\}", r"\^\s*\\circ", r"\\degree", r"\\\$", r"\$", r"\\%", r"%", r"\{,\}"]
_UNIT = re.compile(r"^(.+?)\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}$")
_TEXT = re.compile(r"\\(?:text|mbox|mathrm|textbf)\s*\{([^{}]*)\}")


def normalize_answer(answer: str) -> str:
    s = answer.strip()
    boxed = last_boxed(s)
    if boxed is not None:  # a reference stored with its \boxed{} still compares
        s = boxed
    for pattern in _REMOVE:
        s = re.sub(pattern, "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    while _UNIT.match(s.strip()):  # "5 \text{ cm}" -> "5"; a whole-text answer is unwrapped below
        s = _UNIT.match(s.strip()).group(1)
    s = _TEXT.sub(r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)  # \frac1{2}
    s = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", s)  # \frac{1}2
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # \sqrt2
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:  # "x=5", "k=-2"
        s = s.split("=")[1]
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", s)  # .5 -> 0.5
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


def as_simple_number(normalized: str) -> Optional[Fraction]:
    """The value of an integer, a decimal or a fraction of integers (normalised form), else None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", normalized)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?", normalized):
            return Fraction(normalized)
    except ZeroDivisionError:
        return None
    return None


def answers_equivalent(a: str, b: str) -> bool:
    na, nb = normalize_answer(a), normalize_answer(b)
    if not na or not nb:
        return False
    if na == nb:
        return True
    x, y = as_simple_number(na), as_simple_number(nb)
    return x is not None and x == y


def math_score(solution_str: str, ground_truth: str, extra=None) -> float:
    answer = last_boxed(solution_str)
    return 1.0 if answer is not None and answers_equivalent(answer, ground_truth) else 0.0


def check_ground_truth(ground_truth: str) -> Optional[str]:
    if not normalize_answer(ground_truth):
        return (f"ground_truth {ground_truth!r} is empty after normalisation; expected the boxed answer, "
                "e.g. '\\frac{1}{2}'")
    return None
