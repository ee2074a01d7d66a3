"""Walk a raw value (from YAML, the CLI, a recipe) against the schema's types.

`check_value` returns a normalized copy or raises a ConfigError naming the dotted key, the value,
the expected type and where the value came from; an unknown key gets a did-you-mean drawn from the
same section, from a field of that name in another section, or from all keys of the schema.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import typing
from typing import Callable, List, Mapping, Tuple, Union

from verl_hpc.config.errors import ConfigError, did_you_mean, show
from verl_hpc.config.schema import JobConfig

_INTERP = re.compile(r"(?<!\\)\$\{")  # an unescaped '${': OmegaConf resolves and types it later


def dotted(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _optional_inner(tp):
    if typing.get_origin(tp) is Union:
        return [a for a in typing.get_args(tp) if a is not type(None)][0]
    return tp


def type_at(key: str, cls=JobConfig):
    """The schema type of a dotted key ('trainer.total_steps'), Optional stripped; None if unknown."""
    tp = cls
    for part in re.findall(r"[^.\[\]]+", key):
        if dataclasses.is_dataclass(tp) and part in _hints(tp):
            tp = _optional_inner(_hints(tp)[part])
        elif typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1]
        else:
            return None
    return tp


@functools.lru_cache(maxsize=None)
def all_paths(cls=JobConfig, prefix: str = "") -> Tuple[str, ...]:
    """Every dotted leaf key of the schema: the candidates for did-you-mean."""
    out: List[str] = []
    for name, tp in _hints(cls).items():
        inner = _optional_inner(tp)
        if dataclasses.is_dataclass(inner):
            out += all_paths(inner, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return tuple(out)


def type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of str to {type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a section (a mapping of keys)"
    return {bool: "bool (true/false)", int: "int", float: "float", str: "str"}.get(tp, str(tp))


def _scalar(value, tp):
    """(ok, value converted to tp). Lenient where YAML is surprising, strict where it matters."""
    if value is None or isinstance(value, (dict, list)):
        return False, value
    if tp is bool:  # only true/false: 0/1 or "yes" for a bool is more likely a mistake
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return True, value.lower() == "true"
        return isinstance(value, bool), value
    if tp is str:  # experiment_name: 2024, env values: 1
        if isinstance(value, bool):
            return True, "true" if value else "false"
        return True, str(value)
    if isinstance(value, bool):  # a bool is an int in Python, but never a number in a config
        return False, value
    number = value
    if isinstance(value, str):  # PyYAML reads 1e-6 (no dot) as a string; so are quoted numbers
        try:
            number = int(value) if tp is int else float(value)
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                return False, value
    if tp is float and isinstance(number, (int, float)):
        return True, float(number)
    if tp is int and isinstance(number, float) and number.is_integer():
        return True, int(number)  # 4e9 bytes
    return tp is int and isinstance(number, int), number


def _exact(value, tp):
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    return type(value) is tp, value


# Keys that moved to another section: an old config gets the new name, not a did-you-mean guess.
MOVED = {"rollout.bucket_mb": "resharding.bucket_mb", "reward.allow_custom_code": "safety.allow_custom_code"}


def _unknown_key(path: tuple, value, cls, where) -> ConfigError:
    moved = MOVED.get(dotted(path))
    if moved:
        return ConfigError(f"config key '{dotted(path)}' (from {where(path)}) moved to '{moved}': "
                           f"rename it there")
    # Name the whole key when the unknown part leads to a single value (as a CLI override does).
    full = list(path)
    while isinstance(value, dict) and len(value) == 1:
        key, value = next(iter(value.items()))
        full.append(str(key))
    name, bad, prefix, rest = ".".join(full), path[-1], list(path[:-1]), full[len(path):]
    paths = all_paths()
    suggestions = []
    if not rest:  # a real field, but in another section
        suggestions = [p for p in paths if p.rsplit(".", 1)[-1] == bad][:3]
    if not suggestions:
        close = did_you_mean(bad, list(_hints(cls)))
        if close:
            guess = ".".join(prefix + [close] + rest)
            suggestions = [guess if guess in paths or not rest else ".".join(prefix + [close])]
    if not suggestions and not prefix:  # the section itself is wrong: compare whole keys
        close = did_you_mean(name, paths)
        suggestions = [close] if close else []
    text = f"unknown config key '{name}' (from {where(path)})"
    if suggestions:
        return ConfigError(f"{text}: did you mean " + " or ".join(f"'{s}'" for s in suggestions) + "?")
    section = f"in '{dotted(tuple(prefix))}'" if prefix else "sections"
    return ConfigError(f"{text}; valid {section}: {', '.join(_hints(cls))}")


def check_value(value, tp, path: tuple, where: Callable[[tuple], str], mode: str = "raw"):
    """A checked, normalized copy of `value` against schema type `tp`, or a ConfigError.

    mode "raw": user input; '${...}' is left for OmegaConf, scalars are converted leniently (a
    quoted "10" for an int, 1e-6 read as a string by YAML). "resolved": the same without
    interpolation. "exact": a config object built in Python, whose values must have their types.
    """
    if mode == "raw" and isinstance(value, str) and _INTERP.search(value):
        return value
    if typing.get_origin(tp) is Union:  # Optional[X]
        return None if value is None else check_value(value, _optional_inner(tp), path, where, mode)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if value is None and mode == "raw":
            return {}  # "model:" with every key commented out
        if not isinstance(value, Mapping):
            raise _type_error(path, tp, value, where)
        out = {}
        for key, sub in value.items():
            if str(key) not in _hints(tp):
                raise _unknown_key(path + (str(key),), sub, tp, where)
            out[str(key)] = check_value(sub, _hints(tp)[str(key)], path + (str(key),), where, mode)
        return out
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, tp, value, where)
        item = typing.get_args(tp)[0]
        if item is str and all(type(v) is str for v in value):  # what the check gives each: itself
            return list(value)  # (a loop in C: 600,000 stop strings in ms, not seconds)
        return [check_value(v, item, path + (i,), where, mode) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _type_error(path, tp, value, where)
        item = typing.get_args(tp)[1]
        return {str(k): check_value(v, item, path + (str(k),), where, mode) for k, v in value.items()}
    ok, converted = _exact(value, tp) if mode == "exact" else _scalar(value, tp)
    if not ok:
        raise _type_error(path, tp, value, where)
    return converted


def _type_error(path, tp, value, where) -> ConfigError:
    return ConfigError(f"{dotted(path)}: expected {type_name(tp)}, got {show(value)} (from {where(path)})")
