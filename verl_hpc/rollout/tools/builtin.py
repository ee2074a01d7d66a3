"""The built-in tools: `calculator` (exact arithmetic, in process) and `python` (model-written code,
run by the sandbox in a process of its own).

Each tool is a function of its JSON arguments returning the text the model reads. A tool that
fails raises: the pool (pool.py) turns the exception into an error observation and counts it.
The docstrings of the functions the model calls are what it is told about them (the registry
builds the chat template's tool schemas from them), so they are written for the model.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Callable, Dict, Union

from verl_hpc.rollout.tools.calls import ToolFailed

MAX_EXPRESSION_CHARS = 1000
MAX_DIGITS = 1000  # of an integer, given or computed: enough for any exercise, far below a hang
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))
PYTHON_STDERR_LINES = 6  # of a failed run's stderr: a traceback's end says what went wrong

Number = Union[int, float]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Integers of any size are exact; numbers with a decimal point are floats. Operators:
    + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "12345 * 67890" or "(2 + 3) ** 4 / 7".
    """
    if isinstance(expression, (int, float)) and not isinstance(expression, bool):
        expression = str(expression)  # a model that writes {"expression": 42} means the number
    if not isinstance(expression, str):
        raise ValueError(f"expression must be text such as \"12 * 34\", got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expression)} characters; the limit is {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _evaluate(tree.body)
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from None
    except RecursionError:
        raise ValueError("expression nested too deeply") from None
    return str(value) if isinstance(value, int) else repr(value)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
           ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ZeroDivisionError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large for a float") from None
    raise ValueError(f"{_describe(node)} is not allowed: numbers, + - * / // % ** and parentheses only")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Constant):
        return f"the value {node.value!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    return _SYMBOL.get(type(getattr(node, "op", None))) or type(node).__name__.lower()


def _power(base: Number, exponent: Number) -> Number:
    """base ** exponent, refused before it is computed when the result would be too large (so
    9**9**9 is an error at once, not minutes of work and gigabytes of digits)."""
    if base == 0 and exponent < 0:
        raise ZeroDivisionError("zero to a negative power")
    if abs(base) > 1 and exponent > 0:
        try:
            digits = exponent * math.log10(abs(base))
        except OverflowError:  # an exponent too large for a float: far past the limit
            digits = math.inf
        if digits > MAX_DIGITS:
            size = f"about {digits:.3g} digits" if math.isfinite(digits) else "too many digits to count"
            raise ValueError(f"result would have {size}; the limit is {MAX_DIGITS}")
    try:
        value = base ** exponent
    except OverflowError:
        raise ValueError("result too large for a float") from None
    if isinstance(value, complex):
        raise ValueError("result is not a real number (a negative number to a fractional power)")
    return value


def _checked(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError(f"result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    return value


def run_python(code: str, sandbox) -> str:
    """`code` run by `sandbox` (a verl_hpc.rollout.tools.sandbox.Sandbox): what it printed, or
    ToolFailed with that, the sandbox's verdict and the last lines of stderr."""
    if not isinstance(code, str):
        raise ValueError(f"code must be text, got {type(code).__name__}")
    result = sandbox.run_python(code)
    if result.ok:
        return result.stdout or "(no output: print() what you want to see)"
    verdict = f"error: {result.status.replace('_', ' ')}"
    if result.exit_code is not None:
        verdict += f" (exit code {result.exit_code})"
    tail = "\n".join(result.stderr.rstrip().splitlines()[-PYTHON_STDERR_LINES:])
    raise ToolFailed("\n".join(part for part in (result.stdout.rstrip(), verdict, tail) if part))


def python_tool(get_sandbox: Callable[[], object]) -> Callable[[str], str]:
    """The `python` tool, calling the sandbox `get_sandbox()` returns (built on first use)."""

    def python(code: str) -> str:
        """Run a Python program and return what it prints to stdout (print() every result you need).

        It runs in a sandbox with a time and memory limit, a private scratch folder as its working
        directory and no network.

        Args:
            code: The complete program, for example "print(12345 * 67890)".
        """
        return run_python(code, get_sandbox())

    return python


# What this module implements, for callers without a config (a test keeps it equal to
# multi_turn.tools's choices): each builds the tool's function from a getter of the python tool's
# sandbox, which only `python` calls.
BUILTINS: Dict[str, Callable[[Callable[[], object]], Callable[..., str]]] = {
    "calculator": lambda get_sandbox: calculator, "python": python_tool}
