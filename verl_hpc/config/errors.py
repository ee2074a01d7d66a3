"""The one exception type of the config system, and the did-you-mean helper its messages share.

A bad config must never end in a traceback: every problem becomes one human line that names the
field (or file) at fault and what would be valid. Several semantic problems found together travel
in one `ConfigError` so that a user fixes them in one round instead of one per submission.
"""
from __future__ import annotations

import difflib
from typing import Iterable, List, Optional, Sequence

from verl_hpc.errors import VerlHpcError


class ConfigError(VerlHpcError, ValueError):
    """A bad config. `str(e)` is one line, or a summary line followed by one line per problem."""

    exit_code, kind = 2, "config"

    def __init__(self, message: str, problems: Optional[Sequence[str]] = None):
        self.problems: List[str] = list(problems) if problems else [message]
        super().__init__(message)

    @classmethod
    def from_problems(cls, problems: Sequence[str]) -> "ConfigError":
        if len(problems) == 1:
            return cls(problems[0])
        lines = [f"{len(problems)} problems in the config:"] + [f"  - {p}" for p in problems]
        return cls("\n".join(lines), problems)


def raise_if_any(problems: Sequence[str]) -> None:
    if problems:
        raise ConfigError.from_problems(problems)


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> Optional[str]:
    """The closest candidate to a misspelt `word`, or None when nothing is close enough."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def show(value) -> str:
    """A value as the user would have written it in YAML: null/true/false, strings quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def choice_message(field: str, value, valid: Sequence[str]) -> str:
    """`field: invalid value 'x'; valid: a, b, c (did you mean 'a'?)`."""
    hint = did_you_mean(str(value), valid) if isinstance(value, str) else None
    tail = f" (did you mean {hint!r}?)" if hint else ""
    return f"{field}: invalid value {show(value)}; valid: {', '.join(valid)}{tail}"
