"""User reward functions named 'package.module:function', behind safety.allow_custom_code.

Importing a user module runs its code inside every rank of a (possibly very large) job, so it is
an explicit opt-in, checked here as well as in config validation: the check must hold for code
paths that build a RewardScorer without a validated config.

Signature: fn(data_source, solution_str, ground_truth, extra) -> float | dict(score=float, ...).
A custom function replaces the built-in routing for every sample; it receives data_source and can
delegate to `verl_hpc.rewards.default_score` (same signature) for sources it does not handle.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from typing import Callable, Optional, Sequence, Type

from verl_hpc.rewards.errors import RewardError

CustomFn = Callable[..., object]


def load_custom_function(spec: str, allow_custom_code: bool) -> CustomFn:
    if not allow_custom_code:
        raise RewardError(f"reward.custom_function = {spec!r} runs your own code: set "
                          "safety.allow_custom_code=true to allow it")
    fn = load_user_object("reward.custom_function", spec)
    _check_signature(spec, fn)
    return fn


def load_user_object(field: str, spec: str, error: Type[Exception] = RewardError, kind: str = "function"):
    """The callable a 'package.module:name' spec names (a function, or a class), or one `error`
    naming `field` and the spec: a malformed spec, a module that is missing or fails at import, a
    name the module lacks. Shared by every place a config names user code."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise error(f"{field} = {spec!r}: expected 'package.module:{kind}'")
    problem = module_problem(field, spec)  # the words the submitter's check uses before the queue
    if problem:
        raise error(problem)
    module = _import(field, spec, module_name, error)
    obj = getattr(module, name, None)
    if not callable(obj):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise error(f"{field} = {spec!r}: module {module_name!r} has no {kind} "
                    f"{name!r}; callables there: {', '.join(public) or 'none'}")
    return obj


def module_problem(field: str, spec: str, extra_path: Sequence[str] = ()) -> str:
    """'' or why the module of a 'package.module:name' spec cannot be imported, found out without
    running any of its code (or its packages'): the submitter asks before the queue, on a login node
    where user code must not run, and every rank asks again before it imports the module. Found:
    the module (its packages' folders searched as the import system searches them; `extra_path`
    first, e.g. slurm.env's PYTHONPATH), and its source compiles. What its code does when it runs (an
    exception, a missing dependency) only the import can tell (`load_user_object`)."""
    module_name = spec.partition(":")[0]
    if not module_name or module_name in sys.modules:
        return ""
    parts = module_name.split(".")
    found, path = None, None
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        if name in sys.modules:
            found = getattr(sys.modules[name], "__spec__", None)
            path = getattr(sys.modules[name], "__path__", None)
            continue
        if found is not None and _extends_its_path(found):
            return ""  # a package that makes its __path__ at import: only importing it tells
        try:
            found = _find(name, path if i else None, extra_path)
        except Exception:  # noqa: BLE001 - a finder of the user's that fails: only the import tells
            return ""
        if found is None:
            return _not_found(field, spec, module_name, f"No module named {name!r}")
        path = found.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return _not_found(field, spec, module_name,
                              f"No module named {module_name!r}; {name!r} is not a package")
    try:
        source = found.loader.get_source(module_name) if found.loader is not None else None
    except (ImportError, OSError, AttributeError):  # no source to read (an extension, a frozen module)
        source = None
    if source is None:
        return ""
    try:
        compile(source, found.origin or module_name, "exec", dont_inherit=True)
    except SyntaxError as e:
        return _import_failed(field, spec, module_name, f"{e.filename}, line {e.lineno}", e.msg, e)
    return ""


def _find(name: str, path, extra_path: Sequence[str]):
    """The spec the import system would find for `name` in `path` (a package's folders; None:
    top level), without importing a parent package."""
    if path is None and extra_path:
        spec = importlib.machinery.PathFinder.find_spec(name, list(extra_path))
        if spec is not None:
            return spec
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path, None) if find_spec is not None else None
        if spec is not None:
            return spec
    return None


def _extends_its_path(spec) -> bool:
    """A package whose __init__ changes its own __path__ (pkgutil.extend_path and friends)."""
    try:
        source = spec.loader.get_source(spec.name) if spec.loader is not None else None
    except (ImportError, OSError, AttributeError):
        return False
    return bool(source) and "__path__" in source


def _not_found(field: str, spec: str, module_name: str, why: str) -> str:
    return f"{field} = {spec!r}: cannot import module {module_name!r} ({why}); valid: a module on PYTHONPATH on every node"


def _import(field: str, spec: str, module_name: str, error: Type[Exception]):
    """The user's module; a module that is not there, or whose own code fails while it is imported
    (a SyntaxError, any exception, a sys.exit), is one `error` naming the file and line."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise error(_not_found(field, spec, module_name, str(e))) from e
        failure = e  # the module is there, but something it imports is not
    except SyntaxError as e:  # the traceback ends in the compiler; the error itself knows where
        raise error(_import_failed(field, spec, module_name, f"{e.filename}, line {e.lineno}", e.msg, e)) from e
    except (Exception, SystemExit) as e:  # noqa: BLE001 - user code: any failure is reported the same way
        failure = e
    raise error(_import_failed(field, spec, module_name, _user_line(failure), str(failure), failure)) from failure


def _import_failed(field: str, spec: str, module_name: str, where: Optional[str], text: str,
                   exc: BaseException) -> str:
    text = " ".join(text.split())  # one line, whatever the exception's message holds
    return (f"{field} = {spec!r}: importing module {module_name!r} failed"
            f"{' at ' + where if where else ''}: {type(exc).__name__}{': ' + text if text else ''}")


_LIBRARY_DIRS = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib")})


def _user_line(exc: BaseException) -> Optional[str]:
    """'file, line N' of the deepest frame in the user's own code: not importlib's machinery, not
    the standard library (the module may have called json.loads on a bad file)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    own = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS)] or frames
    return f"{own[-1].filename}, line {own[-1].lineno}" if own else None


def _check_signature(spec: str, fn: CustomFn) -> None:
    """Refuse at start-up a function that could never be called with the four arguments."""
    try:
        inspect.signature(fn).bind("ds", "solution", "truth", {})
    except TypeError as e:
        raise RewardError(f"reward.custom_function = {spec!r}: cannot be called as "
                          f"fn(data_source, solution_str, ground_truth, extra) ({e})") from e
    except ValueError:  # builtins without a signature: let the first call decide
        pass
