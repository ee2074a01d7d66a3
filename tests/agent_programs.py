"""Agent programs for the tests: each written against the `openai` client only, as a user's would be.

`conversation` makes 8 calls in four ways an agent treats its history: appending replies and tool
results (the endpoint rebuilds these from its own ids: merged), truncating it (a split), editing a
reply before sending it back (re-templated: a split), and a raw completion. The others fail in one
way each (tests/unit/rollout/test_agent_runs.py)."""
import time

import openai

CALLS = 8


def _client(config):
    return openai.OpenAI(base_url=config["base_url"], api_key=config["api_key"], max_retries=0,
                         timeout=config["timeout"])


def _ask(client, config, messages, **kw):
    r = client.chat.completions.create(model=config["model"], messages=messages, max_tokens=kw.pop("max_tokens", 6), **kw)
    return r.choices[0].message


def conversation(row, config):
    c = _client(config)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": row["ground_truth"]}]
    for k in range(3):  # append: reply + a tool result of the agent's own
        reply = _ask(c, config, messages)
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": f"tool says {k}"}]
    messages = [messages[0], messages[-1]]  # truncate the history
    for _ in range(2):
        reply = _ask(c, config, messages)
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    reply = _ask(c, config, messages)
    edited = {"role": "assistant", "content": (reply.content or "") + "!"}  # a re-templated reply
    _ask(c, config, messages + [edited, {"role": "user", "content": "last"}])
    c.completions.create(model=config["model"], prompt=f"Q: {row['ground_truth']} A:", max_tokens=5)
    return (1.0 if row["sample_index"] % 2 == 0 else 0.0), {"calls": CALLS}


def one_call(row, config):
    """One call, then a reward: what the training job's agent does."""
    reply = _ask(_client(config), config, [{"role": "user", "content": row["prompt"]}], max_tokens=8)
    return 1.0 if (reply.content or "").strip().startswith(str(row["ground_truth"])) else 0.0


def raises(row, config):
    _ask(_client(config), config, [{"role": "user", "content": "x"}])
    raise KeyError("the agent's own bug")


def exits(row, config):
    raise SystemExit(3)


def sleeps(row, config):
    _ask(_client(config), config, [{"role": "user", "content": "x"}])
    time.sleep(3600)  # a daemon thread: the run is abandoned at agent.timeout_s
    return 1.0


def floods(row, config):
    c = _client(config)
    try:
        while True:
            _ask(c, config, [{"role": "user", "content": "again"}], max_tokens=1)
    except openai.RateLimitError:
        return 1.0


def no_calls(row, config):
    return 1.0


def raises_first(row, config):
    """Raises before its first model call: a failed run with nothing to train on."""
    raise RuntimeError("could not set itself up")


ENDED_URLS = []  # the base URLs one_call_and_remember was given (a test calls them after the run)


def one_call_and_remember(row, config):
    ENDED_URLS.append((config["base_url"], config["api_key"]))
    return one_call(row, config)


def nan_reward(row, config):
    _ask(_client(config), config, [{"role": "user", "content": "x"}])
    return float("nan")


def bool_reward(row, config):
    _ask(_client(config), config, [{"role": "user", "content": "x"}])
    return True


def bad_tuple(row, config):
    _ask(_client(config), config, [{"role": "user", "content": "x"}])
    return 1.0, 2.0


def floods_and_raises(row, config):
    """Floods without catching the 429: its run raised, and it counts as flooded."""
    c = _client(config)
    while True:
        _ask(c, config, [{"role": "user", "content": "again"}], max_tokens=1)


SEEN_URLS = []  # the base URLs two_calls was given in this process (tests/dist/trainer/agent_ranks.py)


def two_calls(row, config):
    """Asks, sends the reply back with one more question (the endpoint rebuilds that history from
    its own ids: merged), and notes the base URL it was given."""
    SEEN_URLS.append(config["base_url"])
    c = _client(config)
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = _ask(c, config, messages)
    _ask(c, config, messages + [reply.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}])
    return float(row["sample_index"] % 2)


def mixed(row, config):
    """A group of four runs of every kind the job must survive (tests/jobs/test_agent_job.py): sample 0
    returns without a call, 1 raises before its first call, 2 sends token ids outside the vocabulary
    and negative ones (400s it catches), then two conversations (two sequences), 3 one call."""
    k = row["sample_index"]
    if k == 0:
        return 1.0
    if k == 1:
        raise RuntimeError("could not set itself up")
    c = _client(config)
    if k == 2:
        for bad in ([5, 10**7], [5, -3]):
            try:
                c.completions.create(model=config["model"], prompt=bad, max_tokens=2)
            except openai.BadRequestError:
                pass
            else:
                raise AssertionError(f"prompt {bad} was served")
        _ask(c, config, [{"role": "user", "content": row["prompt"]}])
        _ask(c, config, [{"role": "user", "content": "something else"}])  # not an extension: a split
        return 0.75
    _ask(c, config, [{"role": "user", "content": row["prompt"]}])
    return 0.25
