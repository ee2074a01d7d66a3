"""Build a `JobConfig` from YAML files, `extends`, dotted CLI overrides and a named recipe.

Precedence, lowest first:
  dataclass defaults < recipe (algorithm.recipe) < YAML files < CLI overrides
and among files: for `extends: [a.yaml, b.yaml]` in c.yaml the order is a < b < c (a parent's own
parents come before it, recursively), so the file you point at always has the last word.

Each layer (one file, one override, the recipe) is checked on its own before merging, so an unknown
key or a wrong type is reported with the file and line (or the override) it came from. The merged
layers then go through OmegaConf's structured config (typed merge + interpolation), whose errors are
translated into the same one-line style, and the resolved values are checked once more (an
interpolation may produce a value of the wrong type).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import GrammarParseError, InterpolationKeyError, OmegaConfBaseException
from omegaconf.errors import ValidationError

from verl_hpc.config import lists
from verl_hpc.config.errors import ConfigError, choice_message, did_you_mean, raise_if_any, show
from verl_hpc.config.fields import choice_problems, recipes_module
from verl_hpc.config.schema import JobConfig
from verl_hpc.config.structure import all_paths, check_value, dotted, type_at, type_name


class Layer(NamedTuple):
    data: dict
    where: Callable[[tuple], str]  # path -> "configs/x.yaml, line 3": where a value came from


# ---------------------------------------------------------------------------------- YAML files
def _mark_line(mark) -> str:
    return f", line {mark.line + 1}" if mark is not None else ""


def _key_lines(node, path: tuple, out: dict, file: str) -> None:
    """Line number of every key, and an error for duplicate keys (PyYAML silently keeps the last)."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen = set()
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        key = key_node.value
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"duplicate key '{dotted(path + (key,))}' in '{file}', line {line}")
        seen.add(key)
        out[path + (key,)] = line
        _key_lines(value_node, path + (key,), out, file)


_DECIMAL = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")


class _ConfigConstructors:
    """YAML 1.1 reads 0x10 as 16, 010 as 8 and 1:30 as 90; in a config those are typos more often
    than intent. Non-decimal integers stay text, which an int field then rejects by name."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        return super().construct_yaml_int(node) if _DECIMAL.match(text) else text

    def construct_yaml_bool(self, node):
        """Only true/false are booleans: YAML 1.1 also reads yes/no/on/off as booleans, so
        `method: off` would reach a choice field as false. As on the command line (parse_value),
        those words stay text; a bool field then names what it takes."""
        text = self.construct_scalar(node)
        return super().construct_yaml_bool(node) if text.lower() in ("true", "false") else text


class _ConfigLoader(_ConfigConstructors, yaml.SafeLoader):
    """PyYAML's pure-Python parser: command-line values, and the words of a file's syntax error."""


# libyaml's parser, where PyYAML was built with it: the same nodes, the same constructors, about 7x
# faster (a 6 MB config: minutes of parsing with the pure one on a loaded login node)
_FastLoader = type("_FastLoader", (_ConfigConstructors, yaml.CSafeLoader), {}) \
    if getattr(yaml, "__with_libyaml__", False) else _ConfigLoader
for _cls in {_ConfigLoader, _FastLoader}:
    _cls.add_constructor("tag:yaml.org,2002:int", _cls.construct_yaml_int)
    _cls.add_constructor("tag:yaml.org,2002:bool", _cls.construct_yaml_bool)


def _parse(text: str, loader_cls, file: str) -> Tuple[Any, Dict[tuple, int]]:
    """One parse: the document's node tree, read once for its keys' lines (and duplicate keys),
    then built into Python values."""
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        lines: Dict[tuple, int] = {}
        if node is not None:
            _key_lines(node, (), lines, file)
        return (loader.construct_document(node) if node is not None else None), lines
    finally:
        loader.dispose()


def read_yaml(path: Path, extended_by: Optional[Path] = None) -> Tuple[dict, Dict[tuple, int]]:
    """(data, key -> line) of one YAML file, with every failure as one ConfigError line."""
    by = f" (extended by '{extended_by}')" if extended_by else ""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: '{path}'{by}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file '{path}'{by} is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file '{path}'{by}: {getattr(e, 'strerror', None) or e}") from None
    try:
        try:
            data, lines = _parse(text, _FastLoader, str(path))
        except yaml.YAMLError:
            if _FastLoader is _ConfigLoader:
                raise
            # libyaml words its errors (and places some) otherwise: the pure parser says what is
            # wrong as it always has; a file libyaml refuses is the rare case that pays for both
            data, lines = _parse(text, _ConfigLoader, str(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"YAML syntax error in '{path}'{_mark_line(mark)}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}' must be a mapping of sections (model:, data:, ...), got {show(data)}")
    return data, lines


def _file_where(file: Path, lines: Dict[tuple, int]) -> Callable[[tuple], str]:
    def where(path: tuple) -> str:
        path = tuple(p for p in path if isinstance(p, str))
        while path and path not in lines:
            path = path[:-1]
        return f"{file}, line {lines[path]}" if path else str(file)

    return where


def file_layers(path: Path, chain: Tuple[Path, ...] = ()) -> List[Layer]:
    """The layers of one file: its `extends` parents (recursively, in order), then the file itself."""
    if path.resolve() in [p.resolve() for p in chain]:
        cycle = " -> ".join(str(p) for p in chain + (path,))
        raise ConfigError(f"extends cycle: {cycle}")
    data, lines = read_yaml(path, chain[-1] if chain else None)
    parents = data.pop("extends", None)
    parents = [parents] if isinstance(parents, str) else parents
    if parents is None:
        parents = []
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{_file_where(path, lines)(('extends',))}: extends must be a file name or a "
                          f"list of file names (relative to this file), got {show(data.get('extends', parents))}")
    layers: List[Layer] = []
    for parent in parents:
        layers += file_layers(Path(os.path.normpath(path.parent / parent)), chain + (path,))
    layers.append(Layer(data, _file_where(path, lines)))
    return layers


# ---------------------------------------------------------------------------------- overrides
_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*$")


# what YAML treats as a line break (it folds or cuts a value there)
_LINE_BREAKS = ("\n", "\r", "\x85", "\u2028", "\u2029")


def parse_value(raw: str) -> Any:
    """A CLI value as a YAML scalar or flow list/mapping; anything YAML rejects stays a string.

    The shell has already split the words, so one word is one value: text YAML would drop or fold
    (a comment after '#', a line break) means the value is text, kept exactly as typed.
    """
    if raw.strip() == "":
        return ""
    if any(b in raw for b in _LINE_BREAKS):
        return raw  # YAML would fold 'a<newline>b' into 'a b', and drop a '#...' line after it
    try:
        if _has_comment(raw):
            return raw  # 'run #3' is a name, not 'run' and a comment
        value = yaml.load(raw, Loader=_ConfigLoader)
    except yaml.YAMLError:
        return raw  # e.g. "%j/logs": '%' starts a YAML directive, but the user meant a string
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        return raw  # YAML 1.1 reads yes/no/on/off as booleans; on a command line they are words
    if not isinstance(value, (str, int, float, bool, list, dict, type(None))):
        return raw  # dates, timestamps: keep what the user typed
    return value


def _has_comment(raw: str) -> bool:
    """Whether YAML would read a '#' of `raw` as a comment: one that lies outside every token
    (a '#' inside a scalar, 'a#b' or "'#y'", belongs to that scalar's token)."""
    if "#" not in raw:
        return False
    spans = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(raw, Loader=yaml.SafeLoader)]
    return any(not any(a <= i < b for a, b in spans) for i, c in enumerate(raw) if c == "#")


def parse_override(text: str) -> dict:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}; the value may itself contain '='."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"malformed override {text!r}: expected key=value, e.g. trainer.total_steps=10")
    if not _KEY.match(key):
        raise ConfigError(f"malformed override {text!r}: {key!r} is not a dotted config key "
                          "like trainer.total_steps")
    nested: Any = parse_value(raw)
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested


# ---------------------------------------------------------------------------------- composition
def deep_merge(dst: dict, src: Mapping) -> dict:
    """Mappings merge key by key; everything else (lists included) is replaced."""
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            deep_merge(dst[key], value)
        else:
            dst[key] = _copy(value)
    return dst


def _copy(value):
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if all(type(v) is str for v in value):  # the long lists (stop strings, files): a loop in C
            return list(value)
        return [_copy(v) for v in value]
    return value


def _recipe_layer(user: dict) -> dict:
    name = (user.get("algorithm") or {}).get("recipe")
    if name is None:
        return {}
    recipes = recipes_module().RECIPES
    if name not in recipes:
        raise ConfigError(choice_message("algorithm.recipe", name, sorted(recipes)))
    where = lambda path: f"recipe {name!r} in verl_hpc/config/recipes.py"  # noqa: E731
    return check_value(recipes[name], JobConfig, (), where)


def _lookup(container: Any, full_key: str) -> Any:
    for part in re.findall(r"[^.\[\]]+", full_key or ""):
        try:
            container = container[int(part)] if isinstance(container, list) else container[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return None
    return container


def _translate(e: OmegaConfBaseException, conf, layers: Sequence[dict]) -> str:
    """OmegaConf's multi-line exception -> our one line naming the field and the interpolation.

    `layers` (user values first, then the recipe, then the defaults) give the unresolved value.
    """
    key = getattr(e, "full_key", None) or "config"
    msg = str(getattr(e, "msg", None) or e).splitlines()[0]
    msg = msg.split("raised while resolving interpolation: ", 1)[-1].strip('"')
    raw = next((v for v in (_lookup(layer, key) for layer in layers) if v is not None), None)
    if isinstance(e, GrammarParseError):
        return f"{key}: malformed interpolation {show(raw)}: {msg} (write \\${{...}} for a literal '${{')"
    if isinstance(e, InterpolationKeyError):
        missing = re.search(r"key '([^']*)'", msg)
        missing = missing.group(1) if missing else "?"
        text = f"{key}: cannot resolve {show(raw)}: no config key '{missing}'"
        hint = did_you_mean(missing, all_paths())
        if hint:
            return f"{text} (did you mean '{hint}'?)"
        if "." not in missing:  # e.g. a shell variable in slurm.setup
            return (f"{text}; write \\${{{missing}}} for a literal '${{{missing}}}', or "
                    f"${{oc.env:{missing}}} for the environment variable")
        return text
    if isinstance(e, ValidationError) and raw is not None:
        try:  # resolve once more without types, to show what the interpolation produced
            value = OmegaConf.select(OmegaConf.create(OmegaConf.to_container(conf)), key)
        except (OmegaConfBaseException, ValueError):  # conf is None when the merge itself failed
            value = "?"
        return f"{key}: {show(raw)} gives {show(value)}, expected {type_name(type_at(key))}"
    return f"{key}: cannot resolve {show(raw)}: {msg}"


@functools.lru_cache(maxsize=1)
def _defaults():
    """The typed defaults, built once: building a structured config costs ~30 ms, merging ~8."""
    return OmegaConf.structured(JobConfig)


@functools.lru_cache(maxsize=1)
def _default_interpolations() -> tuple:
    return tuple(lists.interpolations(to_container(JobConfig())))


def compose(layers: Sequence[Layer]) -> JobConfig:
    """Check each layer, merge them over the recipe and the defaults, resolve, check, finish."""
    user: dict = {}
    for layer in layers:
        deep_merge(user, check_value(layer.data, JobConfig, (), layer.where))
    recipe = _recipe_layer(user)
    # plain lists skip OmegaConf, which takes ~150 us an item (config/lists.py)
    lifted = lists.lift(user, lists.referred([*lists.interpolations(user), *lists.interpolations(recipe),
                                              *_default_interpolations()]))
    conf = None
    try:
        conf = OmegaConf.merge(_defaults(), recipe, user)  # merge copies: the cache stays intact
        plain = OmegaConf.to_container(conf, resolve=True)
    except OmegaConfBaseException as e:
        lists.put_back(user, lifted)
        raise ConfigError(_translate(e, conf, [user, recipe, to_container(JobConfig())])) from None
    lists.put_back(plain, lifted)
    # Interpolations are resolved now: a '${' left in a value is literal text, not to be typed.
    resolved = check_value(plain, JobConfig, (), lambda path: "an interpolation", mode="resolved")
    cfg = build(JobConfig, resolved).resolve()
    raise_if_any(choice_problems(cfg))
    return cfg


def build(cls, data: dict):
    """Dataclass instances from a complete, checked plain dict (no interpolation left to resolve)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = data[f.name]
        inner = type_at(f.name, cls)
        kwargs[f.name] = build(inner, value) if dataclasses.is_dataclass(inner) else value
    return cls(**kwargs)


# ---------------------------------------------------------------------------------- public API
def load_config(path: Union[str, os.PathLike, None] = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults < recipe < the YAML file (with its extends) < `overrides` ("a.b=value" strings)."""
    layers = file_layers(Path(path)) if path is not None else []
    if isinstance(overrides, str):
        overrides = [overrides]
    for text in overrides or ():
        layers.append(Layer(parse_override(text), lambda p, t=text: f"command line {t!r}"))
    return compose(layers)


def escape_interpolations(value):
    """Make '${' literal for OmegaConf: values of a resolved config are final text."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, Mapping):
        return {k: escape_interpolations(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_interpolations(v) for v in value]
    return value


def to_container(cfg: JobConfig) -> dict:
    """A plain nested dict (picklable, JSON-able) with every field, auto fields filled in."""
    return dataclasses.asdict(cfg)


def from_container(data: Union[Mapping, JobConfig]) -> JobConfig:
    """The inverse of `to_container`; also accepts a partial dict (defaults and recipe fill the rest).

    Values are taken literally: a '${' in them is text, since `to_container` output is resolved.
    """
    if isinstance(data, JobConfig):
        data = to_container(data)
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config container must be a mapping of sections, got {show(data)}")
    return compose([Layer(escape_interpolations(data), lambda path: "a config container")])


def to_yaml(cfg: JobConfig) -> str:
    """Resolved YAML that `load_config` reads back to an equal config.

    Non-ASCII is escaped: written raw, some characters (U+0085, U+2028) read back as line breaks.
    """
    return yaml.dump(escape_interpolations(to_container(cfg)), Dumper=_FastDumper, sort_keys=False,
                     default_flow_style=False, allow_unicode=False)


# libyaml's emitter where PyYAML was built with it: the same text as the pure one (the shipped configs,
# odd strings), about 3x faster (600,000 stop strings: 1.8 CPU-s, 5.1 with the pure one), and every
# checkpoint stores the config's text
_FastDumper = yaml.CSafeDumper if getattr(yaml, "__with_libyaml__", False) else yaml.SafeDumper
