"""How a config section declares a field, and the checks that follow from the declaration.

Each field is declared once, with everything about it in one place:

    n: int = opt(1, "responses per prompt", check=">0")
    engine: str = opt("vllm", "rollout engine", choices=("vllm", "hf"))
    max_tokens: int = opt(0, "generated tokens per response at most", check=">=0",
                          auto="data.max_response_length")

The default, the help text shown in `configs/base.yaml` (generated from these declarations), the
valid choices or range, and what an "auto" value becomes. `field_problems` turns the declaration
into one-line errors; a section's `check()` adds the rules that involve several fields, and its
`resolve()` fills its auto fields. Plain dataclasses (not pydantic) because OmegaConf's structured
configs, which give interpolation and typed merging, are built from dataclasses, and the loader's
own type walk already reports the file and line of every bad value with a did-you-mean.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Sequence, Tuple

from verl_hpc.config.errors import ConfigError, choice_message, show

if TYPE_CHECKING:  # the job config imports every section; sections only need its type
    from verl_hpc.config.schema import JobConfig

# Upper bounds of values a running job hands to code that cannot take more; each is far beyond
# any real job, so a value past it is a typo (a unit mix-up, an extra zero), refused before the queue.
WEEK_S = 7 * 24 * 3600  # timeouts: threading/time.sleep overflow past threading.TIMEOUT_MAX (~292 years)
SEED_MAX = 2**32 - 1  # vLLM seeds numpy's global RNG with rollout.seed, which takes [0, 2**32)
MAX_BATCH = 2**20  # prompts or sequences per batch: the planner's per-rank arithmetic stops meaning anything
MAX_TOKENS = 2**24  # tokens per prompt or response (the model's max_position_embeddings is checked too)
INT64 = (-(2**63), 2**63 - 1)  # torch tensors, HDF5 attributes and numpy hold step counts and seeds as int64


def opt(default: Any, help: str = "", *, choices: Optional[Sequence[str]] = None,
        choices_from: Optional[str] = None, check: Optional[str] = None, auto: Optional[str] = None):
    """A dataclass field carrying its documentation and checks.

    choices: valid values (list fields: per item). choices_from: the name of a tuple in
    `verl_hpc.config.recipes` (algorithm vocabulary lives there, next to the registries it mirrors).
    check: ">0", ">=0" or an interval such as "[0, 1)" / "(0, 1]". auto: what an empty/null/0
    value is replaced with when the config is loaded (documentation; the section's resolve() does it).
    Mutable defaults (lists, dicts) are copied per instance.
    """
    meta = {"help": help, "choices": tuple(choices) if choices else None, "choices_from": choices_from,
            "check": check, "auto": auto}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls, help: str = ""):
    """A nested section field: `optim: OptimConfig = section(OptimConfig)`."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


class Section:
    """Base of every config section: its own cross-field checks and auto values.

    `check(job)` returns problems (one line each) for rules that involve more than one field;
    it may read other sections of `job` but reports against its own fields. `resolve(job)` fills
    this section's auto fields from the rest of the job (idempotent).
    """

    def check(self, job: "JobConfig") -> List[str]:
        return []

    def resolve(self, job: "JobConfig") -> None:
        pass


# ---------------------------------------------------------------------------------- declared checks
def _interval(value: float, spec: str) -> bool:
    if spec == ">0":
        return value > 0
    if spec == ">=0":
        return value >= 0
    low, high = (float(x) for x in spec[1:-1].split(","))
    above = value > low if spec[0] == "(" else value >= low
    below = value < high if spec[-1] == ")" else value <= high
    return above and below


def check_message(key: str, value, spec: str) -> str:
    if spec in (">0", ">=0"):
        return f"{key}: must be {spec[:-1]} 0, got {value}"
    return f"{key}: must be in {spec}, got {value}"


def walk(obj, prefix: str = "") -> Iterator[Tuple[str, Any, dict, Any]]:
    """(dotted key, value, field metadata, owning section) for every leaf field."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from walk(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value, f.metadata, obj


def sections(obj, prefix: str = "") -> Iterator[Tuple[str, Section]]:
    """(dotted name, section) of every nested section, parents before children."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield prefix + f.name, value
            yield from sections(value, f"{prefix}{f.name}.")


def recipes_module():
    """verl_hpc.config.recipes, imported by name: here (not in the loader, which imports this
    module) so that the config modules import each other one way."""
    try:
        return importlib.import_module("verl_hpc.config.recipes")
    except Exception as e:  # noqa: BLE001 - any failure here blocks every config: say what it was
        raise ConfigError(f"cannot import the recipe table verl_hpc.config.recipes: {e}") from None


def valid_choices(meta: dict) -> Optional[Tuple[str, ...]]:
    if meta.get("choices_from"):
        return tuple(getattr(recipes_module(), meta["choices_from"]))
    return meta.get("choices")


def choice_problems(cfg, prefix: str = "") -> List[str]:
    """One problem per field whose value is not among its valid names (list fields: per item).
    `prefix` names a lone section in the messages ("optim.")."""
    problems: List[str] = []
    for key, value, meta, _ in walk(cfg, prefix):
        valid = valid_choices(meta)
        if valid is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if item is not None and item not in valid:
                problems.append(choice_message(key, item, valid))
    return problems


def _outside_int64(value) -> bool:
    items = value if isinstance(value, list) else [value]
    return any(type(v) is int and not INT64[0] <= v <= INT64[1] for v in items)


def range_problems(cfg, prefix: str = "") -> List[str]:
    """Non-finite floats (YAML accepts .nan / .inf, and NaN passes every comparison), integers
    past int64 (Python's have no limit, torch's and HDF5's do) and the declared `check` of every
    numeric field. `prefix` as in choice_problems."""
    problems: List[str] = []
    for key, value, meta, _ in walk(cfg, prefix):
        bad = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, float) and not math.isfinite(v)]
        if bad:  # a list of floats (gdpo_reward_weights, betas) too: one NaN weight makes every loss NaN
            problems.append(f"{key}: must be {'finite numbers' if isinstance(value, list) else 'a finite number'}, "
                            f"got {show(value) if isinstance(value, list) else value}")
        elif _outside_int64(value):
            problems.append(f"{key}: must be a 64-bit integer in [-2**63, 2**63 - 1], got {show(value)}")
        elif meta.get("check") and value is not None and not _interval(value, meta["check"]):
            problems.append(check_message(key, value, meta["check"]))
    return problems
