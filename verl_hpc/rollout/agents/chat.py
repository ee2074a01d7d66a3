"""OpenAI chat messages -> the prompt ids the engine samples from, and a completion -> the reply.

A conversation's history is made of the model's own earlier replies. Rendering them again through
the chat template and encoding the text does not always give the ids the model sampled (a byte-level
BPE can split the same text differently), and a training sequence built from such a prompt would
hold tokens the policy never produced. So where the agent sends back, unchanged, the reply this
endpoint gave it (same earlier messages, same tools, same assistant content and tool calls), the
prompt is built from the recorded ids: that call's prompt ids, its sampled ids, the template's end
of the assistant turn (TurnCodec.close_ids), then the new messages as the template renders them.
Any other history (re-templated, truncated, thinking dropped) is rendered from text as any server
would; the trajectory then splits at that call (verl_hpc/rollout/agents/trajectory.py).

Tool calls are written by the model in its own format (Hermes/Qwen `<tool_call>{json}</tool_call>`,
parsed by the multi-turn code's parser) and returned in the OpenAI schema; assistant messages with
OpenAI `tool_calls` are handed to the template with their arguments as objects, the form the
ChatML templates render.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from verl_hpc.rollout.episodes.chat_turns import TurnCodec
from verl_hpc.rollout.tools.calls import CLOSE, OPEN, parse_tool_calls


class BadRequest(ValueError):
    """A malformed request: answered with HTTP 400 (or `status`) and an OpenAI-style error body naming
    `param`. Not a VerlHpcError: the server turns it into the agent's HTTP response; it never
    reaches a user as an exception."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{k}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                 "are served", param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _calls(raw: Any, where: str) -> List[Tuple[str, Any]]:
    """An assistant message's OpenAI tool_calls as (name, arguments object) pairs."""
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        raise BadRequest(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for k, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{k}] needs function.name", param=f"{where}.tool_calls")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as text: the template renders it as given
        out.append((fn["name"], args))
    return out


def normalize(messages: Any) -> List[Dict[str, Any]]:
    """The request's messages in the form the template and the history comparison read."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"{where}.role must be one of system, developer, user, assistant, tool",
                             param=f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: Dict[str, Any] = {"role": role, "content": content_text(m.get("content"), where)}
        if role == "assistant":
            calls = _calls(m.get("tool_calls"), where)
            if calls:
                msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def check_tools(tools: Any) -> Any:
    """The request's `tools`, as OpenAI defines them: a list of {"type": "function", "function":
    {"name": str, "description"?: str, "parameters"?: object}}. The chat template renders them, so
    anything else would fail there or be rendered as nonsense."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name": ...}}', param="tools")
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequest(f'{where} must be an object with "type": "function"', param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise BadRequest(f'{where}.function must be an object with a "name" (a non-empty string)',
                             param=f"{where}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"{where}.function.parameters must be a JSON schema object",
                             param=f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise BadRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
    return tools


def _same_reply(msg: Dict[str, Any], reply: Dict[str, Any]) -> bool:
    """Is the agent's assistant message the reply this endpoint gave (ids of calls aside)?"""
    strip = lambda m: (m["content"], [(c["function"]["name"], c["function"]["arguments"])  # noqa: E731
                                      for c in m.get("tool_calls", [])])
    return msg["role"] == "assistant" and strip(msg) == strip(reply)


class ChatPrompts:
    """Builds prompt ids from messages, over one tokenizer's chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.codec = TurnCodec(tokenizer)

    def render(self, messages, tools, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation)

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def prompt_ids(self, messages: List[Dict[str, Any]], tools, history: Sequence[Any]) -> Tuple[List[int], bool]:
        """(ids, reused): `history` holds this sample's earlier chat calls (objects with messages,
        tools, reply, prompt_ids, completion_ids), newest last."""
        for call in reversed(history):
            k = len(call.messages)
            if (len(messages) > k and call.tools == tools and messages[:k] == call.messages
                    and _same_reply(messages[k], call.reply)):
                ids = self._continued(call, messages, tools)
                if ids is not None:
                    return ids, True
        return self.encode(self.render(messages, tools, True)), False

    def _continued(self, call, messages, tools) -> Optional[List[int]]:
        k = len(call.messages)
        if not call.completion_ids:
            return None
        base, full = self.render(messages[:k + 1], tools, False), self.render(messages, tools, True)
        if not full.startswith(base):  # the template renders earlier turns differently later on
            return None
        return (list(call.prompt_ids) + list(call.completion_ids)
                + self.codec.close_ids(call.completion_ids[-1]) + self.encode(full[len(base):]))

    def reply(self, completion_ids: List[int], stop: Sequence[str]) -> Tuple[Dict[str, Any], bool]:
        """(the assistant message in the OpenAI schema, has tool calls)."""
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        text = cut_at_stop(text, stop)
        if OPEN not in text:
            return {"role": "assistant", "content": text}, False
        parsed = parse_tool_calls(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, False
        outside = text.split(OPEN)[0]
        tail = text.rsplit(CLOSE, 1)[-1] if CLOSE in text else ""
        content = (outside + tail).strip()
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
        return {"role": "assistant", "content": content or None, "tool_calls": calls}, True


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string (OpenAI leaves the stop string out of the content; the
    recorded ids keep the token that completed it, as the engine sampled it)."""
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return text if cut < 0 else text[:cut]


def recorded_reply(message: Dict[str, Any]) -> Dict[str, Any]:
    """The reply as the history comparison reads it (normalize()'s form)."""
    return normalize([message])[0]
