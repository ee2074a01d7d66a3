"""Tool calls as the model writes them, in the Hermes/Qwen format most chat templates use:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12345 * 67890"}}</tool_call>

A turn may hold several calls; text outside the tags is the model's own and is ignored here. A
call the model got wrong (bad JSON, no name, arguments that are not an object, a tag left open at
the end of the turn) is not an exception: it becomes an error text the model reads in its next
observation, numbered by the call's place in the turn, so the episode goes on and the error is
counted. So is JSON that Python's reader refuses with something else than a JSONDecodeError:
nesting past the recursion limit, an integer of more than MAX_INT_DIGITS digits.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_INT_DIGITS = 4300  # Python's default limit on int <-> str conversion (sys.int_info.default_max_str_digits)
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedCalls:
    calls: List[ToolCall] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)  # one "error: tool call N: ..." line per bad call


class ToolFailed(Exception):
    """A tool ran and failed, and its message is the whole observation the model reads (the python
    tool's output and the sandbox's verdict). Not a VerlHpcError: the pool turns it into an outcome
    with error "tool_error"; it never reaches a user as an exception."""


def has_tool_call(text: str) -> bool:
    return OPEN in text


def parse_tool_calls(text: str) -> ParsedCalls:
    parsed = ParsedCalls()
    end = 0
    for number, match in enumerate(_CALL.finditer(text), start=1):
        _add(parsed, number, match.group(1))
        end = match.end()
    if OPEN in text[end:]:  # generation stopped (or the model moved on) before the call was closed
        number = len(parsed.calls) + len(parsed.errors) + 1
        parsed.errors.append(f"error: tool call {number}: {OPEN} is not closed by {CLOSE}")
    return parsed


def _add(parsed: ParsedCalls, number: int, body: str) -> None:
    call = _call_or_problem(body)
    if isinstance(call, ToolCall):
        parsed.calls.append(call)
    else:
        parsed.errors.append(f"error: tool call {number}: {call}")


def _int(digits: str) -> int:
    """json's parse_int: Python refuses to convert more than 4,300 digits (sys.int_info), with a
    ValueError that is not a JSONDecodeError; the limit is fixed here, with its own message, so
    that a process-wide sys.set_int_max_str_digits does not change which calls are valid."""
    count = len(digits.lstrip("-"))
    if count > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {count} digits; at most {MAX_INT_DIGITS}")
    return int(digits)


def _loads(text: str) -> Tuple[Any, str]:
    """(value, '') or (None, what is wrong): JSON the model wrote, never an exception."""
    try:
        return json.loads(text, parse_int=_int), ""
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at char {e.pos}"
    except ValueError as e:  # _int's refusal
        return None, str(e)
    except RecursionError:  # json's C reader recurses once per nesting level
        return None, "nested too deeply"


def _call_or_problem(body: str) -> Union[ToolCall, str]:
    data, problem = _loads(body)
    if problem:
        return f"invalid JSON ({problem})"
    if not isinstance(data, dict):
        return f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {_json_kind(data)}'
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'no "name" (the tool\'s name, a string)'
    raw = data.get("arguments", {})  # a tool without parameters may be called without it
    arguments = _arguments(raw)
    if arguments is None:
        got = "a string that is not a JSON object" if isinstance(raw, str) else _json_kind(raw)
        return f'"arguments" must be a JSON object, got {got}'
    return ToolCall(name.strip(), arguments)


def _arguments(value: Any) -> Optional[Dict[str, Any]]:
    """The arguments object; some models write it as a JSON string holding the object."""
    if isinstance(value, str):
        value, problem = _loads(value)
        if problem:
            return None
    return value if isinstance(value, dict) else None


def _json_kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "true/false", type(None): "null",
             int: "a number", float: "a number", dict: "an object"}
    return names.get(type(value), type(value).__name__)
