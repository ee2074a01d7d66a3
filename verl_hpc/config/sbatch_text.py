"""Values that end up in the sbatch script: one line each, names that are names.

A newline in `slurm.additional`, `slurm.env`, `slurm.setup` (or any other slurm.* string) would
start a new `#SBATCH` option or shell command of the user's choosing; other control characters
(escape sequences, NUL) have no business there either. Tabs are harmless and allowed.
"""
from __future__ import annotations

import dataclasses
import re
from typing import List

_SBATCH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _control(value: str) -> str:
    m = _CONTROL.search(value)
    return f"character {m.group()!r}" if m else ""


def _strings(obj, prefix: str):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _strings(value, f"{prefix}{f.name}.")
        elif isinstance(value, str):
            yield prefix + f.name, value
        elif isinstance(value, list):
            yield from ((f"{prefix}{f.name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, str))


def sbatch_text_problems(slurm) -> List[str]:
    p = [f"{key}: contains {_control(v)}; a value written into the sbatch script must be one line without "
         "control characters" for key, v in _strings(slurm, "slurm.") if _control(v)]
    for key, value in slurm.additional.items():
        if not _SBATCH_OPTION.match(key):
            p.append(f"slurm.additional: {key!r} is not an sbatch option name (letters, digits, '-' or '_', "
                     "e.g. mail-type)")
        elif _control(str(value)):
            p.append(f"slurm.additional.{key}: contains {_control(str(value))}; valid: a one-line value")
    for key, value in slurm.env.items():
        if not _ENV_NAME.match(key):
            p.append(f"slurm.env: {key!r} is not an environment variable name (letters, digits, '_'; "
                     "not starting with a digit)")
        elif _control(str(value)):
            p.append(f"slurm.env.{key}: contains {_control(str(value))}; valid: a one-line value")
    return p
