"""The OpenAI API over the batcher: what /v1/chat/completions and /v1/completions do for a sample.

Each agent run gets a `Session` (its own base URL carries the session's key). A request is checked,
turned into prompt ids, sampled through the batcher and recorded as a `Call` of the session, by
token id, before the response is sent. Sampling is the job's (rollout.temperature, top_p, top_k:
the trainer computes its log-probs under them); a request's own temperature/top_p/top_k/seed are
ignored and counted. A request sets max_tokens (capped at rollout.max_tokens) and stop strings (the
job's rollout.stop where it names none). `logprobs` is served from the recorded log-probs of the
sampled tokens (chat: `logprobs: true`; completions: `logprobs: 0`), in OpenAI's shape, one entry
per sampled token; alternatives (`top_logprobs`, completions' `logprobs` > 0) are refused, as are
`n` > 1, `stream` and a `response_format` other than text: the policy samples free text, and
answering them as if served would mislead an agent.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from verl_hpc.rollout.agents.batcher import Batcher
from verl_hpc.rollout.agents.chat import BadRequest, ChatPrompts, check_tools, cut_at_stop, normalize, recorded_reply
from verl_hpc.rollout.agents.trajectory import Call

IGNORED = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")
MAX_STOPS = 4  # OpenAI's own limit


@dataclasses.dataclass
class ChatCall:
    """A chat call's history entry (chat.ChatPrompts.prompt_ids reads it)."""
    messages: List[Dict[str, Any]]
    tools: Any
    reply: Dict[str, Any]
    prompt_ids: List[int]
    completion_ids: List[int]


class Session:
    """One agent run: the calls it made, its limit, and whether it is still running."""

    def __init__(self, key: str, max_calls: int):
        self.key, self.max_calls = key, int(max_calls)
        self.calls: List[Call] = []
        self.chats: List[ChatCall] = []
        self.flooded = False
        self.open = True
        self.reused = 0  # chat calls whose history was the endpoint's own ids
        self.lock = threading.Lock()
        self._order = 0
        self._in_flight = 0  # calls admitted and not yet answered
        self._answered = time.monotonic()  # when its last call was answered

    def admit(self) -> int:
        with self.lock:
            if not self.open:
                raise BadRequest("this sample's agent run has ended (time limit or done); the call is not served",
                                 status=409, code="run_ended")
            if self._order >= self.max_calls:
                self.flooded = True
                raise BadRequest(f"more than agent.max_calls = {self.max_calls} model calls in one run",
                                 status=429, code="too_many_calls")
            self._order += 1
            self._in_flight += 1
            return self._order

    def record(self, call: Call, chat: Optional[ChatCall] = None, reused: bool = False) -> None:
        with self.lock:
            if self.open:  # a call that finished after the run ended belongs to no trajectory
                self.calls.append(call)
                if chat is not None:
                    self.chats.append(chat)
                self.reused += reused

    def due(self, now: float, horizon: float) -> bool:
        """Running, with no call in flight, and either not yet called the model or answered less than
        `horizon` seconds ago: its next request is likely on its way (the batcher waits for it)."""
        return self.open and not self._in_flight and (self._order == 0 or now - self._answered < horizon)

    def answered(self) -> None:
        with self.lock:
            self._in_flight -= 1
            self._answered = time.monotonic()

    def close(self) -> None:
        with self.lock:
            self.open = False


class AgentService:
    def __init__(self, batcher: Batcher, tokenizer, *, model_name: str, max_tokens: int, window: int):
        self.batcher, self.tokenizer = batcher, tokenizer
        self.chat = ChatPrompts(tokenizer)
        self.model_name, self.max_tokens, self.window = model_name, int(max_tokens), int(window)
        self.ignored = 0  # requests whose sampling fields were ignored
        self._lock = threading.Lock()

    def models(self) -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "verl_hpc"}]}

    # ------------------------------------------------------------------ the two completion routes
    def chat_completion(self, session: Session, body: Dict[str, Any]) -> Dict[str, Any]:
        max_tokens, stop = self._common(body)
        messages, tools = normalize(body.get("messages")), check_tools(body.get("tools"))
        logprobs = body.get("logprobs")
        if logprobs not in (None, True, False):
            raise BadRequest("logprobs must be true or false", param="logprobs")
        if body.get("top_logprobs") not in (None, 0):
            raise BadRequest("top_logprobs is not served: only the sampled tokens' log-probs (logprobs: true)",
                             param="top_logprobs")
        order = session.admit()
        try:
            with session.lock:
                history = list(session.chats)
            prompt_ids, reused = self.chat.prompt_ids(messages, tools, history)
            sampled = self._sample(prompt_ids, max_tokens, stop)
        finally:
            session.answered()
        message, has_calls = self.chat.reply(sampled.ids, stop)
        call = Call(prompt_ids, sampled.ids, sampled.logprobs, sampled.finish_reason, order)
        session.record(call, ChatCall(messages, tools, recorded_reply(message), prompt_ids, sampled.ids), reused)
        finish = "tool_calls" if has_calls else sampled.finish_reason
        lp = {"content": self._token_logprobs(sampled), "refusal": None} if logprobs else None
        return self._envelope("chat.completion", {"index": 0, "message": message, "finish_reason": finish,
                                                  "logprobs": lp}, prompt_ids, sampled.ids)

    def completion(self, session: Session, body: Dict[str, Any]) -> Dict[str, Any]:
        max_tokens, stop = self._common(body, default_tokens=16)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = self.chat.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise BadRequest("prompt must be a non-empty string or list of token ids (one prompt per request)",
                             param="prompt")
        if not prompt_ids:
            raise BadRequest("prompt is empty", param="prompt")
        self._check_ids(prompt_ids)
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise BadRequest("logprobs must be a non-negative integer (0: the sampled tokens' log-probs)",
                             param="logprobs")
        if logprobs:
            raise BadRequest(f"logprobs = {logprobs} asks for the top alternatives, which are not served; "
                             "logprobs: 0 gives the sampled tokens' log-probs", param="logprobs")
        if body.get("echo"):
            raise BadRequest("echo is not served: the reply holds the completion only", param="echo")
        order = session.admit()
        try:
            sampled = self._sample(prompt_ids, max_tokens, stop)
        finally:
            session.answered()
        session.record(Call(prompt_ids, sampled.ids, sampled.logprobs, sampled.finish_reason, order))
        text = cut_at_stop(self.tokenizer.decode(sampled.ids, skip_special_tokens=True), stop)
        lp = None
        if logprobs is not None:
            entries = self._token_logprobs(sampled)
            offsets = [sum(len(e["token"]) for e in entries[:k]) for k in range(len(entries))]
            lp = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                  "top_logprobs": None, "text_offset": offsets}
        return self._envelope("text_completion", {"index": 0, "text": text, "finish_reason": sampled.finish_reason,
                                                  "logprobs": lp}, prompt_ids, sampled.ids)

    # ------------------------------------------------------------------ shared parts
    def _common(self, body: Dict[str, Any], default_tokens: Optional[int] = None) -> Tuple[int, Tuple[str, ...]]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} is not served here; GET /v1/models lists {self.model_name!r}",
                             param="model", status=404, code="model_not_found")
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("n must be 1 (call again for more samples: each call is a sample of the run)", param="n")
        if body.get("stream"):
            raise BadRequest("stream is not served: ask for the whole completion", param="stream")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise BadRequest("response_format is not served (no JSON mode or schema: the policy samples free "
                             "text); leave it out or use {\"type\": \"text\"}", param="response_format")
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        if raw is None:
            max_tokens = default_tokens or self.max_tokens
        elif isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
            max_tokens = min(raw, self.max_tokens)
        else:
            raise BadRequest("max_tokens must be a positive integer", param="max_tokens")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings", param="stop")
        stop = stop or getattr(self.batcher, "default_stop", ())  # none named: the job's rollout.stop
        if any(body.get(k) is not None for k in IGNORED):
            with self._lock:
                self.ignored += 1
        return max_tokens, tuple(stop)

    def _check_ids(self, ids: List[int]) -> None:
        """Token ids the tokenizer knows: an id past the vocabulary would reach the engine and fail there."""
        vocab = len(self.tokenizer)
        bad = next((k for k, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"prompt[{bad}] = {ids[bad]} is not a token id of this model (0 <= id < {vocab})",
                             param="prompt", code="invalid_token_id")

    def _token_logprobs(self, sampled) -> List[Dict[str, Any]]:
        """OpenAI's per-token entries for the sampled ids, with the log-probs the engine recorded."""
        out = []
        for t, lp in zip(sampled.ids, sampled.logprobs):
            text = self.tokenizer.decode([t])
            out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")), "top_logprobs": []})
        return out

    def _sample(self, prompt_ids: List[int], max_tokens: int, stop):
        if len(prompt_ids) + max_tokens > self.window:
            room = self.window - len(prompt_ids)
            if room < 1:
                raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; this endpoint's context is {self.window} "
                                 "(data.max_prompt_length + data.max_response_length)", param="messages",
                                 code="context_length_exceeded")
            max_tokens = room  # as vLLM's server: the completion stops at the context's end
        return self.batcher.submit(prompt_ids, max_tokens, stop)

    def _envelope(self, kind: str, choice: Dict[str, Any], prompt_ids, completion_ids) -> Dict[str, Any]:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                          "total_tokens": len(prompt_ids) + len(completion_ids)}}
