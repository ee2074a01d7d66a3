"""The agent endpoint over HTTP, driven by the `openai` client unmodified: routes, the token, OpenAI
error bodies, tool calls in the OpenAI schema, and histories rebuilt from the recorded ids.

The engine here is a scripted batcher (what it samples is set by the test), so what the endpoint
does with the ids can be checked exactly; tests/unit/rollout/test_agent_runs.py runs the real one."""
import json
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from verl_hpc.rollout.agents.batcher import Sampled
from verl_hpc.rollout.agents.server import AgentServer
from verl_hpc.rollout.agents.service import AgentService, Session

TOOL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class ScriptedBatcher:
    """Returns the next scripted completion (ids) for every request, and keeps what it was sent."""

    default_stop = ("<END>",)  # the job's rollout.stop

    def __init__(self, tokenizer):
        self.tok, self.script, self.sent = tokenizer, [], []

    def submit(self, prompt_ids, max_tokens, stop):
        self.sent.append((list(prompt_ids), max_tokens, stop))
        ids = self.script.pop(0) if self.script else self.tok("ok", add_special_tokens=False)["input_ids"]
        ids = list(ids)[:max_tokens]
        return Sampled(ids, [-0.25] * len(ids), "stop")


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def endpoint(tok):
    batcher = ScriptedBatcher(tok)
    service = AgentService(batcher, tok, model_name="policy", max_tokens=128, window=400)
    sessions = {"run1": Session("run1", max_calls=6)}
    server = AgentServer(service, sessions.get)
    client = openai.OpenAI(base_url=server.base_url("run1"), api_key=server.token, max_retries=0)
    yield server, batcher, sessions["run1"], client
    server.close()


def eos(tok):
    return [tok.convert_tokens_to_ids("<|im_end|>")]


def test_chat_reply_tool_calls_and_a_history_rebuilt_from_the_sampled_ids(endpoint, tok):
    server, batcher, session, client = endpoint
    assert [m.id for m in client.models.list().data] == ["policy"]
    sampled = tok(TOOL_TEXT, add_special_tokens=False)["input_ids"] + eos(tok)
    batcher.script = [sampled]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "2+3?"}]
    r = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}
    assert r.usage.completion_tokens == len(sampled)
    # the agent appends the reply and its tool's result, as agents do
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
    client.chat.completions.create(model="policy", messages=messages, tools=tools)
    first, second = batcher.sent[0][0], batcher.sent[1][0]
    assert second[:len(first) + len(sampled)] == first + sampled  # token for token, no re-tokenizing
    assert session.reused == 1
    assert [c.prompt_ids for c in session.calls] == [first, second]
    assert session.calls[0].completion_ids == sampled and session.calls[0].logprobs == [-0.25] * len(sampled)


def test_a_rewritten_history_is_rendered_from_text(endpoint, tok):
    server, batcher, session, client = endpoint
    batcher.script = [tok("hello there", add_special_tokens=False)["input_ids"]]
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": r.choices[0].message.content + " (edited)"},
                 {"role": "user", "content": "more"}]
    client.chat.completions.create(model="policy", messages=messages)
    assert session.reused == 0
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert batcher.sent[1][0] == tok(expected, add_special_tokens=False)["input_ids"]


def test_completions_take_text_or_token_ids_and_stop_strings_leave_the_text(endpoint, tok):
    server, batcher, session, client = endpoint
    batcher.script = [tok("abc STOP", add_special_tokens=False)["input_ids"]]
    r = client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=500, stop=["STOP"])
    assert batcher.sent[0] == ([5, 6, 7], 128, ("STOP",))  # max_tokens capped at rollout.max_tokens
    assert "STOP" not in r.choices[0].text and r.choices[0].text.startswith("abc")
    client.completions.create(model="policy", prompt="some text", max_tokens=4)
    assert batcher.sent[1][0] == tok("some text", add_special_tokens=False)["input_ids"]
    assert batcher.sent[1][2] == ("<END>",)  # no stop named: the job's
    assert len(session.calls) == 2


def raw(server, path, body=None, token=None, method=None, scheme="Bearer"):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, method=method,
                                 headers={"Authorization": f"{scheme} {token or server.token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CHAT = "/agents/run1/v1/chat/completions"
OK = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("path, body, token, status, needle", [
    (CHAT, OK, "sk-wrong", 401, "invalid or missing API key"),
    (CHAT, b"{not json", None, 400, "not JSON"),
    (CHAT, {"messages": []}, None, 400, "messages must be a non-empty list"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages[0].role"),
    (CHAT, {**OK, "n": 2}, None, 400, "n must be 1"),
    (CHAT, {**OK, "stream": True}, None, 400, "stream is not served"),
    (CHAT, {**OK, "max_tokens": -3}, None, 400, "max_tokens must be a positive integer"),
    (CHAT, {**OK, "model": "gpt-4"}, None, 404, "model 'gpt-4' is not served"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 400}]}, None, 400, "this endpoint's context is 400"),
    ("/agents/nobody/v1/chat/completions", OK, None, 404, "no agent run 'nobody'"),
    ("/v1/chat/completions", OK, None, 404, "base URL your run was given"),
    ("/agents/run1/v1/embeddings", OK, None, 404, "no route POST"),
    ("/agents/run1/v1/completions", {"prompt": [1.5]}, None, 400, "prompt must be"),
    # ids the engine would fail on: refused before it, for this request only
    ("/agents/run1/v1/completions", {"prompt": [5, 10**7]}, None, 400, "prompt[1] = 10000000 is not a token id"),
    ("/agents/run1/v1/completions", {"prompt": [5, -3]}, None, 400, "prompt[1] = -3 is not a token id"),
    (CHAT, {**OK, "tools": [1, "x"]}, None, 400, "tools[0] must be an object with \"type\": \"function\""),
    (CHAT, {**OK, "tools": [{"type": "function"}]}, None, 400, "tools[0].function must be an object with a \"name\""),
    (CHAT, {**OK, "tools": [{"type": "function", "function": {"name": 5}}]}, None, 400, "tools[0].function"),
    (CHAT, {**OK, "tools": {"type": "function"}}, None, 400, "tools must be a list"),
    (CHAT, {**OK, "response_format": {"type": "json_object"}}, None, 400, "response_format is not served"),
    (CHAT, {**OK, "logprobs": True, "top_logprobs": 3}, None, 400, "top_logprobs is not served"),
    (CHAT, {**OK, "logprobs": "yes"}, None, 400, "logprobs must be true or false"),
    ("/agents/run1/v1/completions", {"prompt": [5], "logprobs": 2}, None, 400, "logprobs = 2 asks for the top"),
])
def test_malformed_requests_get_openai_error_bodies(endpoint, path, body, token, status, needle):
    server, batcher, session, _ = endpoint
    code, reply = raw(server, path, body, token)
    assert code == status, reply
    assert needle in reply["error"]["message"] and reply["error"]["type"]
    assert not session.calls and not batcher.sent  # nothing reached the engine


def test_a_run_past_its_calls_or_its_end_is_refused(endpoint):
    server, batcher, session, client = endpoint
    for _ in range(6):
        client.completions.create(model="policy", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.RateLimitError, match="agent.max_calls = 6"):
        client.completions.create(model="policy", prompt=[1, 2], max_tokens=2)
    assert session.flooded
    session.close()
    code, reply = raw(server, "/agents/run1/v1/completions", {"prompt": [1]})
    assert code == 409 and reply["error"]["code"] == "run_ended"


def test_logprobs_are_served_from_the_recorded_log_probs(endpoint, tok):
    server, batcher, session, client = endpoint
    sampled = tok("four", add_special_tokens=False)["input_ids"] + eos(tok)
    batcher.script = [sampled, sampled]
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2?"}], logprobs=True)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == [-0.25] * len(sampled) == session.calls[0].logprobs
    assert "".join(c.token for c in content) == tok.decode(sampled)
    assert client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                          response_format={"type": "text"}).choices[0].logprobs is None
    r = client.completions.create(model="policy", prompt=[5, 6], max_tokens=8, logprobs=0)
    assert r.choices[0].logprobs.token_logprobs == [-0.25] * len(r.choices[0].logprobs.tokens)


def test_http_variants_a_client_may_send(endpoint):
    """Chunked bodies, `bearer` in any case, other methods, and a body past the limit: each an
    OpenAI answer the client can read, on a connection that stays usable."""
    import http.client

    server, batcher, session, client = endpoint
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode()
    chunks = iter([body[:7], body[7:]])
    conn.request("POST", "/agents/run1/v1/completions", body=chunks, encode_chunked=True,
                 headers={"Authorization": f"bearer {server.token}", "Content-Type": "application/json",
                          "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert json.loads(resp.read())["object"] == "text_completion"
    assert batcher.sent[-1][0] == [5, 6]
    for method in ("PUT", "DELETE", "PATCH", "FOO"):  # the same connection, kept alive after each
        conn.request(method, "/agents/run1/v1/completions", body=b"{}",
                     headers={"Authorization": f"Bearer {server.token}"})
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        assert resp.status == 405 and resp.getheader("Content-Type") == "application/json", reply
        assert f"method {method}" in reply["error"]["message"].replace("'", "")
        if resp.getheader("Connection") == "close":  # an unknown method: the parser gave up on the request
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.close()
    assert raw(server, "/agents/run1/v1/completions", {"prompt": [5]}, scheme="BEARER")[0] == 200
    # 17 MB: the client reads the 413 (not a broken pipe), and does not ask again
    before = server.requests
    with pytest.raises(openai.APIStatusError) as e:
        client.with_options(max_retries=2).completions.create(model="policy", prompt="x" * (17 << 20), max_tokens=2)
    assert e.value.status_code == 413 and "at most" not in str(e.value) and "16777216" in str(e.value)
    assert server.requests == before + 1
    client.completions.create(model="policy", prompt=[5], max_tokens=2)  # the server goes on
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/agents/run1/v1/completions")
    conn.putheader("Content-Length", "-5")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 400 and "Content-Length" in json.loads(resp.read())["error"]["message"]
    conn.close()


def test_errors_tell_the_openai_client_not_to_retry(endpoint):
    """The openai client retries 409, 429 and 5xx by default: asking again changes none of ours."""
    server, batcher, session, client = endpoint
    session.close()
    before = server.requests
    with pytest.raises(openai.ConflictError, match="run has ended"):
        client.with_options(max_retries=2).completions.create(model="policy", prompt=[1], max_tokens=2)
    assert server.requests == before + 1


def test_the_server_listens_on_loopback_only(tok):
    with pytest.raises(ValueError, match="loopback"):
        AgentServer(None, {}.get, host="0.0.0.0")
