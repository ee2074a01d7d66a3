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
import inspect
import os
import sysconfig
import traceback
from typing import Callable, Optional, Type

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
    module = _import(field, spec, module_name, error)
    obj = getattr(module, name, None)
    if not callable(obj):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise error(f"{field} = {spec!r}: module {module_name!r} has no {kind} "
                    f"{name!r}; callables there: {', '.join(public) or 'none'}")
    return obj


def _import(field: str, spec: str, module_name: str, error: Type[Exception]):
    """The user's module; a module that is not there, or whose own code fails while it is imported
    (a SyntaxError, any exception, a sys.exit), is one `error` naming the file and line."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise error(f"{field} = {spec!r}: cannot import module {module_name!r} ({e}); "
                        "is it on PYTHONPATH on every node?") from e
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
