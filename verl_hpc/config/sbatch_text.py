"""Values that end up in the sbatch script: one line each, names that are names, options that
the plan does not already own.

A newline in `slurm.additional`, `slurm.env`, `slurm.setup` (or any other slurm.* string) would
start a new `#SBATCH` option or shell command of the user's choosing; other control characters
(escape sequences, NUL) have no business there either. Tabs are harmless and allowed.

`#SBATCH` values are written shell-quoted (both script writers quote the way submitit does), and
sbatch's own directive parser reads single and double quotes, spaces, `$`, `;` and `#` inside them
back unchanged, but takes a backslash as an escape even inside single quotes: `a\\b` would reach
Slurm as `ab`, so a backslash is refused in a directive value instead of changing it silently.
"""
from __future__ import annotations

import dataclasses
import re
from typing import List

_SBATCH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# slurm.* fields written as #SBATCH values (log_dir through --output/--error)
_DIRECTIVE_FIELDS = ("job_name", "partition", "account", "qos", "constraint", "log_dir")
# sbatch options the plan writes itself (or must not change under it), with the field that sets
# them: an `additional` copy would make sbatch and the plan disagree (e.g. 5 nodes for a 1-node plan)
_OWNED = {
    "nodes": "slurm.nodes", "ntasks": "slurm.nodes and slurm.tasks_per_node",
    "ntasks-per-node": "slurm.tasks_per_node", "gpus-per-node": "slurm.gpus_per_node",
    "gpus": "slurm.gpus_per_node", "gpus-per-task": "slurm.gpus_per_node",
    "cpus-per-task": "slurm.cpus_per_task", "time": "slurm.time_min",
    "signal": "slurm.signal_delay_s", "output": "slurm.log_dir", "error": "slurm.log_dir",
    "open-mode": "slurm.log_dir", "job-name": "slurm.job_name", "partition": "slurm.partition",
    "account": "slurm.account", "qos": "slurm.qos", "constraint": "slurm.constraint",
    "mem": "slurm.mem_gb", "exclusive": "slurm.exclusive", "requeue": "slurm.requeue",
    "no-requeue": "slurm.requeue", "no-kill": "slurm.max_restarts",
    "array": "",  # "": no field; a run is one job, not an array
}
_SHORT = {"N": "nodes", "n": "ntasks", "G": "gpus", "c": "cpus-per-task", "t": "time", "o": "output",
          "e": "error", "J": "job-name", "p": "partition", "A": "account", "q": "qos",
          "C": "constraint", "a": "array", "k": "no-kill"}


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


def owned_option(key: str) -> str:
    """The plan-owned sbatch option `key` names, or "". sbatch also takes an unambiguous prefix of a
    long option (`--ntasks-per-n`), so a key that begins one is refused too."""
    if len(key) == 1:
        return _SHORT.get(key, "")
    long = key.replace("_", "-")
    return next((o for o in _OWNED if o == long), "") or next((o for o in _OWNED if o.startswith(long)), "")


def _backslash(key: str) -> str:
    return (f"{key}: contains a backslash, which sbatch reads as an escape in an #SBATCH line (Slurm "
            "would get another value); valid: a value without '\\'")


def _directive_problems(slurm) -> List[str]:
    values = [(f"slurm.{f}", getattr(slurm, f)) for f in _DIRECTIVE_FIELDS]
    values += [(f"slurm.additional.{k}", str(v)) for k, v in slurm.additional.items()]
    return [_backslash(key) for key, v in values if "\\" in v]


def directive_value_problems(key: str, value: str) -> List[str]:
    """The rules of an #SBATCH value kept outside `slurm:` (placement.rollout_partition)."""
    p = [f"{key}: contains {_control(value)}; valid: a one-line value"] if _control(value) else []
    return p + ([_backslash(key)] if "\\" in value else [])


def _owned_problems(slurm) -> List[str]:
    p = []
    for key in slurm.additional:
        option = owned_option(key)
        if option:
            field = _OWNED[option]
            p.append(f"slurm.additional.{key}: set {field} instead (--{option} is written from it, so the "
                     "plan and sbatch agree)" if field else
                     f"slurm.additional.{key}: --{option} is not supported (a run is one job, not an array)")
    return p


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
    return p + _owned_problems(slurm) + _directive_problems(slurm)
