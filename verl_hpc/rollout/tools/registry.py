"""The tools a job offers, by name: the built-ins `multi_turn.tools` names and the user's own
(`multi_turn.user_tools`), and the multi-turn environment (`multi_turn.environment`).

User tools. 'package.module:function' names a function called with the call's arguments as
keywords, `fn(**arguments)`, returning the text the model reads (anything else is str()'d); the
tool's name is the function's. The model is told about it by the schema transformers'
`get_json_schema` builds from its signature and docstring, so every argument needs a type hint
and the docstring an `Args:` section. To fail, raise: the model reads `error: <Type>: <message>`.

Environments. 'package.module:Class' names a class built with no arguments, one instance per
episode, instead of tool calls (the signatures are checked against these calls at load; what a
failure of its code does at run time is in environment.py):

    reset(row: dict) -> None                   # the row's `extra`; its prompt opens the episode
    step(turn_text: str) -> (observation: Optional[str], reward: float, done: bool)
                                               # the model's turn as text; what it reads next, this
                                               # turn's reward term, whether the episode ends

Both run the user's code in every rank, so they need safety.allow_custom_code, checked here
again (with the config check's words) for code paths that build a registry without a validated
config. A module that fails at import is one ConfigError naming the spec, the file and the line.

The sandbox behind `python` is built on first use, and only when `python` is offered: building it
probes what the node allows, which a job without the tool need not do.
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from verl_hpc.config.errors import ConfigError, did_you_mean
from verl_hpc.config.sections.multi_turn import needs_custom_code
from verl_hpc.rewards.custom import load_user_object
from verl_hpc.rollout.tools.builtin import BUILTINS
from verl_hpc.rollout.tools.sandbox import Sandbox

ENVIRONMENT_METHODS = ("reset", "step")


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: Dict[str, Any]  # OpenAI-style {"type": "function", "function": {name, description, parameters}}


class ToolRegistry:
    def __init__(self, tools: Sequence[Tool] = (), environment: Optional[type] = None,
                 sandbox_factory: Optional[Callable[[], Any]] = None):
        self._tools: Dict[str, Tool] = {}
        self.environment = environment
        self._sandbox_factory = sandbox_factory
        self._sandbox = None
        self._sandbox_lock = threading.Lock()
        for tool in tools:
            self.add(tool)

    @classmethod
    def from_config(cls, multi_turn, sandbox, *, allow_custom_code: bool,
                    sandbox_factory: Optional[Callable[[], Any]] = None) -> "ToolRegistry":
        """The tools of the multi_turn section; the python tool's sandbox from the sandbox section
        (`sandbox_factory` stands in for Sandbox.from_config(sandbox)); allow_custom_code:
        safety.allow_custom_code."""
        mt, allow = multi_turn, allow_custom_code
        registry = cls(environment=load_environment(mt.environment, allow) if mt.environment else None,
                       sandbox_factory=sandbox_factory or (lambda: _sandbox_from_config(sandbox)))
        for name in mt.tools:
            registry.add(registry._builtin(name))
        for spec in mt.user_tools:
            registry.add(load_user_tool(spec, allow))
        return registry

    def add(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ConfigError(f"multi_turn: two tools are named {tool.name!r}; tool names must differ")
        self._tools[tool.name] = tool

    def _builtin(self, name: str) -> Tool:
        fn = BUILTINS[name](lambda: self.sandbox)
        return Tool(name, fn, describe(fn))

    @property
    def sandbox(self):
        """The python tool's sandbox, built on first use (thread-safe: tools run on the pool's threads)."""
        with self._sandbox_lock:
            if self._sandbox is None:
                if self._sandbox_factory is None:
                    raise RuntimeError("this ToolRegistry was built without a sandbox")
                self._sandbox = self._sandbox_factory()
            return self._sandbox

    def names(self) -> List[str]:
        return list(self._tools)

    def get(self, name: str) -> Optional[Tool]:
        return self._tools.get(name)

    def schemas(self, names: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
        """The schemas of `names` (default: every tool), for a chat template's `tools=` argument."""
        return [self._tools[n].schema for n in (self.names() if names is None else names)]

    def check_offered(self, names: Any) -> Optional[str]:
        """None when `names` (a data row's `tools` field) is a list of this job's tools, else what is
        wrong, for the caller to prefix with the file and row."""
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            return f"tools must be a list of tool names, got {names!r:.80}"
        for name in names:
            if name not in self._tools:
                hint = did_you_mean(name, self._tools)
                return (f"unknown tool {name!r}; valid: {', '.join(self._tools) or 'none (no tools configured)'}"
                        f"{f' (did you mean {hint!r}?)' if hint else ''}")
        return None


def describe(fn: Callable[..., Any], name: Optional[str] = None) -> Dict[str, Any]:
    """The OpenAI-style schema of `fn` from its type hints and docstring (transformers' own
    builder, the one chat templates are documented with)."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(fn)
    if name:
        schema["function"]["name"] = name
    return schema


def load_user_tool(spec: str, allow_custom_code: bool) -> Tool:
    field = "multi_turn.user_tools"
    if not allow_custom_code:
        raise ConfigError(needs_custom_code(field))
    fn = load_user_object(field, spec, ConfigError)
    name = spec.partition(":")[2]
    try:
        inspect.signature(fn)
        schema = describe(fn, name)
    except (ValueError, TypeError) as e:  # a builtin without a signature
        raise ConfigError(f"{field} = {spec!r}: cannot read its signature ({e})") from e
    except Exception as e:  # noqa: BLE001 - transformers' TypeHintParsingException, DocstringParsingException
        raise ConfigError(f"{field} = {spec!r}: cannot describe it to the model ({e}); give every argument "
                          "a type hint and the function a docstring with an Args: section") from e
    return Tool(name, fn, schema)


def load_environment(spec: str, allow_custom_code: bool) -> type:
    """The environment class `spec` names (protocol in this module's docstring)."""
    field = "multi_turn.environment"
    if not allow_custom_code:
        raise ConfigError(needs_custom_code(field))
    cls = load_user_object(field, spec, ConfigError, kind="class")
    missing = [m for m in ENVIRONMENT_METHODS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ConfigError(f"{field} = {spec!r}: expected a class with reset(row) and step(turn_text)"
                          f"{'; it is not a class' if not isinstance(cls, type) else ''}"
                          f"{'; missing: ' + ', '.join(missing) if missing else ''}")
    # the calls the episodes make, tried on the signatures now rather than on the first batch
    for call, method, args, why in ((f"{cls.__name__}()", None, (), "it is built with no arguments, one instance "
                                     "per episode"),
                                    ("reset(row)", "reset", ({},), "each episode starts so"),
                                    ("step(turn_text)", "step", ("",), "each model turn is handed over so")):
        problem = _call_problem(cls, method, args)
        if problem:
            raise ConfigError(f"{field} = {spec!r}: cannot be called as {call} ({problem}); {why}")
    return cls


def _call_problem(cls: type, method: Optional[str], args: tuple) -> str:
    """'' when cls (method None) or its `method` accepts `args` (an instance's bound call), else why not."""
    if method is None:
        fn, bound = cls, args
    else:  # looked up on the class: a plain function still takes self; a static or class method does not
        fn = getattr(cls, method)
        wrapped = isinstance(inspect.getattr_static(cls, method, None), (staticmethod, classmethod))
        bound = args if wrapped else (None, *args)
    try:
        inspect.signature(fn).bind(*bound)
    except TypeError as e:
        return str(e)
    except ValueError:  # no signature to read (a builtin): the first call decides
        pass
    return ""


def _sandbox_from_config(sandbox_cfg):
    return Sandbox.from_config(sandbox_cfg)
