"""Command-line agents (agent.command, extra.agent_command) in the sandbox, on the real rollout
engine (HF generate, the tiny model): a script that uses the `openai` client unmodified (it knows
only OPENAI_BASE_URL / OPENAI_API_KEY) reaches the endpoint from inside the sandbox's own network
namespace, and the training batch holds exactly the ids the endpoint recorded; each way a command
can fail is a counted sample failure, the first logged, and the batch goes on."""
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import pytest
import torch
from test_agent_runs import batch_of, engine, row_ids, tok  # noqa: F401 - fixtures

from verl_hpc.config import ConfigError, load_config
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rollout.agents import AgentOptions, AgentRunner
from verl_hpc.rollout.agents.metrics import agent_metrics
from verl_hpc.rollout.sampling import default_spec
from verl_hpc.rollout.tools.sandbox_command import base_python
from verl_hpc.trainer.stages.batching import assemble
from verl_hpc.trainer.stages.scoring import given_rewards

# the agent as a user writes it: the openai client reads OPENAI_BASE_URL and OPENAI_API_KEY itself
OPENAI_AGENT = """
import json, os, openai
row = json.load(open(os.environ["AGENT_ROW_FILE"]))
client = openai.OpenAI(max_retries=0)
model = os.environ["OPENAI_MODEL"]
messages = [{"role": "user", "content": row["ground_truth"]}]
for k in range(2):  # the replies sent back as they came: merged
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": f"tool says {k}"}]
client.chat.completions.create(model=model, messages=[messages[0], messages[-1]], max_tokens=6)  # truncated: a split
client.completions.create(model=model, prompt="Q: " + row["ground_truth"] + " A:", max_tokens=5)
print("the agent's own log line")
print(json.dumps({"reward": row["sample_index"] % 2, "info": {"calls": 4}}))
"""
# a client of the standard library only (the sandbox's base Python): `calls.py N` makes N chat calls
STDLIB_CALLS = """
import json, os, sys, urllib.request
for _ in range(int(sys.argv[1])):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
                                 data=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3}).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
"""


@pytest.fixture(scope="module")
def scripts():
    """The agents' folder: readable by the sandbox's own uid on a root rank (pytest's tmp_path is
    under a 0700 folder)."""
    folder = tempfile.mkdtemp(prefix="verl_hpc_agent_cmd_")
    os.chmod(folder, 0o755)
    for name, text in (("agent.py", OPENAI_AGENT), ("calls.py", STDLIB_CALLS)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(folder, name), 0o644)
    yield folder
    shutil.rmtree(folder)


def runner(engine, tok, scripts, *overrides):  # noqa: F811
    # the venv holds `openai`; the sandbox's CPU and memory limits sized for a Python process with it
    cfg = load_config(None, ["agent.enable=true", f"agent.read_only_paths=[{sys.prefix},{scripts}]",
                             "sandbox.cpu_time_s=60", "sandbox.memory_mb=2048", *overrides])
    return AgentRunner(engine, tok, AgentOptions(cfg.agent, "zero", True, 6, sandbox=cfg.sandbox))


@pytest.mark.heavy
def test_an_openai_client_command_trains_on_the_recorded_ids(engine, tok, recorded, scripts):  # noqa: F811
    prompts = batch_of(3)
    spec = default_spec(n=2, max_tokens=6, temperature=1.0, top_p=1.0, top_k=-1)
    with runner(engine, tok, scripts, f"agent.command={sys.executable} {scripts}/agent.py",
                "agent.timeout_s=120") as r:
        result = r.generate(prompts, spec)
        assert r.failures_total == 0, r.first_failure
    assert len(recorded) == 3 * 2 * 4
    m = agent_metrics(result)
    assert m["agent/calls"] == 24 and m["agent/failures"] == 0
    assert m["agent/history_reused"] == 6  # the second call sent the first reply back unchanged
    assert m["agent/merges"] == 6 and m["agent/splits"] == 12  # the truncation and the raw completion
    batch = assemble(prompts, result, tok, pad_id=0)
    mask, logp = batch.response_mask, batch.rollout_log_probs
    assert int(mask.sum()) == sum(len(c.completion_ids) for c in recorded)
    rows = [row_ids(batch, r) for r in range(len(batch))]
    for call in recorded:
        full = call.prompt_ids + call.completion_ids
        r = next(r for r, ids in enumerate(rows) if ids[:len(full)] == full)
        p = int(batch.prompt_lengths[r])
        span = slice(len(call.prompt_ids) - p, len(full) - p)
        assert mask[r, span].tolist() == [1.0] * len(call.completion_ids)
        assert torch.equal(logp[r, span], torch.tensor(call.logprobs, dtype=torch.float32))
    # the reward is the last line the command printed
    scores = given_rewards(torch.zeros(len(batch)), result, {})
    assert scores.tolist() == [float(j % 2) for j in result.sample_index]


def calls(scripts, n):
    return f"{base_python()} {scripts}/calls.py {n}"


# each row's command and the failure it must end as
BAD = {
    "exit 3": "exited",  # no call: the exit is what it is counted as
    "CALLS1; exit 3": "exited",
    "CALLS1; sleep 60": "timeout",
    "CALLS1; yes": "exited",  # past sandbox.max_output_bytes
    "CALLS1; echo 'one point five'": "bad_reward",
    "CALLS1; echo '{\"reward\": true}'": "bad_reward",
    "CALLS1; echo '{\"score\": 1}'": "bad_reward",
    "CALLS1; echo NaN": "bad_reward",
    "CALLS1": "bad_reward",  # printed nothing
    "echo 1": "no_calls",
    "CALLS5": "flooded",  # agent.max_calls = 3: urllib raises on the 429, the command exits 1
}


@pytest.mark.heavy
def test_each_failing_command_is_a_counted_sample_failure(engine, tok, scripts, caplog):  # noqa: F811
    commands = [c.replace("CALLS1", calls(scripts, 1)).replace("CALLS5", calls(scripts, 5)) for c in BAD]
    good = f"{calls(scripts, 2)}; echo '{{\"reward\": 0.5, \"info\": {{\"why\": \"fine\"}}}}'"
    prompts = batch_of(len(BAD) + 1)
    for i, c in enumerate([*commands, good]):
        prompts.extras[i]["agent_command"] = c
    # 10 s: the sleeping command's limit, and room for the good one's 2 calls on a loaded machine
    # (at 4 s, one full-suite run had it time out too)
    with runner(engine, tok, scripts, "agent.timeout_s=10", "agent.max_calls=3") as r:
        with caplog.at_level("ERROR"):
            result = r.generate(prompts, default_spec(n=1, max_tokens=3, temperature=1.0))
        assert r.failures_total == len(BAD)
    first = {}
    for i, e in zip(result.prompt_index, result.episodes):
        first.setdefault(i, e.agent)
    assert {c: first[i].failure for i, c in enumerate(BAD)} == BAD
    assert first[len(BAD)].failure == "" and first[len(BAD)].reward == 0.5 and first[len(BAD)].calls == 2
    m = agent_metrics(result)
    assert m["agent/failures"] == len(BAD) and m["agent/failures_bad_reward"] == 5
    assert m["agent/failures_exited"] == 3 and m["agent/failures_timeout"] == 1
    assert sum("agent run failed" in rec.message for rec in caplog.records) == 1  # the first, once
    assert "sample row0: agent run failed (exited): the command exited with code 3" in r.first_failure
    batch = assemble(prompts, result, tok, pad_id=0)
    assert len(set(batch.group_ids.tolist())) == len(BAD) + 1


def test_the_sandbox_keeps_the_agent_off_the_ranks_own_port(engine, tok, scripts):  # noqa: F811
    """The rank's TCP endpoint is not reachable from bwrap's network namespace: only the run's own
    port is (the probe exits 0 when the host port refuses, 1 when it answers)."""
    probe = (f"{base_python()} -c \"import socket,sys; s=socket.socket(); "
             "sys.exit(0 if s.connect_ex(('127.0.0.1', PORT)) else 1)\"")
    prompts = batch_of(1)
    with runner(engine, tok, scripts, "sandbox.mode=bwrap", "agent.timeout_s=20") as r:
        prompts.extras[0]["agent_command"] = f"{probe.replace('PORT', str(r.server.port))} && {calls(scripts, 1)} && echo 1"
        result = r.generate(prompts, default_spec(n=1, max_tokens=3))
        assert r.failures_total == 0, r.first_failure
    assert result.episodes[0].agent.calls == 1


def test_bad_command_settings_are_one_clear_error(engine, tok, scripts):  # noqa: F811
    with pytest.raises(ConfigError, match=r"agent.read_only_paths\[1\]: '/nonexistent/env' does not exist"):
        runner(engine, tok, scripts, "agent.read_only_paths=[/tmp,/nonexistent/env]")
    cfg = load_config(None, ["agent.enable=true"])
    prompts = batch_of(1)
    prompts.extras[0]["agent_command"] = "echo 1"
    with AgentRunner(engine, tok, AgentOptions(cfg.agent, "zero", False, 6)) as r:
        with pytest.raises(RewardError, match="sample row0: extra.agent_command runs your own code: set "
                                              "safety.allow_custom_code=true"):
            r.generate(prompts, default_spec(n=1, max_tokens=3))


def test_closing_the_runner_kills_the_commands_still_running(engine, tok, scripts, recorded):  # noqa: F811
    """A job that stops (its end, preemption) does not wait out agent.timeout_s: the sandbox kills
    its commands, which a Python agent's thread could not be."""
    prompts = batch_of(1)
    prompts.extras[0]["agent_command"] = f"{calls(scripts, 1)}; sleep 600; echo 1"
    r = runner(engine, tok, scripts, "agent.timeout_s=600")
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=r.generate(prompts, default_spec(n=1, max_tokens=3))))
    thread.start()
    deadline = time.monotonic() + 60
    while not recorded and time.monotonic() < deadline:  # the command is past its model call, asleep
        time.sleep(0.05)
    assert recorded
    r.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    stats = out["result"].episodes[0].agent
    assert stats.failure == "exited" and stats.calls == 1
