"""Tool calls as the model writes them, in the Hermes/Qwen format most chat templates use:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12345 * 67890"}}</tool_call>

A turn may hold several calls; text outside the tags is the model's own and is ignored here. A
call the model got wrong (bad JSON, no name, arguments that are not an object, a tag left open at
the end of the turn) is not an exception: it becomes an error text the model reads in its next
observation, numbered by the call's place in the turn, so the episode goes on and the error is
counted.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"
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


def _call_or_problem(body: str) -> Union[ToolCall, str]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at char {e.pos})"
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
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def _json_kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "true/false", type(None): "null",
             int: "a number", float: "a number", dict: "an object"}
    return names.get(type(value), type(value).__name__)
