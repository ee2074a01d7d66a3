"""ToolTurns: a round of model turns -> their tool calls run in the real pool -> one reply per turn.
Errors of every kind are observations the model reads and counted errors; a turn without a call is
the answer; the per-turn penalty is counted per failed call."""
import json

import pytest

from verl_hpc.config import load_config
from verl_hpc.rollout.episodes.runner import Turn
from verl_hpc.rollout.tools.pool import ToolPool
from verl_hpc.rollout.tools.registry import ToolRegistry
from verl_hpc.rollout.tools.turns import ToolTurns


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture
def turns():
    cfg = load_config(None, ["multi_turn.tools=[calculator]"])
    registry = ToolRegistry.from_config(cfg.multi_turn, cfg.sandbox, allow_custom_code=cfg.safety.allow_custom_code)
    responder = ToolTurns(ToolPool(registry, workers=2, timeout_s=5, max_output_chars=200),
                          max_calls_per_turn=2, error_penalty=-0.1)
    yield responder
    responder.close()


def test_each_kind_of_turn_gets_its_reply(turns):
    calc = ("calculator",)
    replies = turns.respond([
        Turn(0, call("calculator", expression="12345*67890"), calc),  # a good call
        Turn(1, "the answer is 7", calc),  # no call: the answer
        Turn(2, '<tool_call>{"name": "calculator", "arguments": {</tool_call>', calc),  # malformed
        Turn(3, call("search", query="x"), calc),  # unknown tool
        Turn(4, call("calculator", expression="1/0"), calc),  # the tool fails
        Turn(5, call("calculator", expression="2+2") * 3, calc),  # past max_calls_per_turn
        Turn(6, call("calculator", expression="2+2"), ()),  # not offered to this row
    ])
    good, answer, bad, unknown, fails, many, hidden = replies
    assert good.observations == [str(12345 * 67890)] and (good.calls, good.errors, good.done) == (1, 0, False)
    assert good.reward == 0.0 and len(good.seconds) == 1
    assert answer.done and answer.observations == [] and answer.calls == 0
    for r in (bad, unknown, fails, hidden):
        assert not r.done and (r.calls, r.errors) == (1, 1) and r.reward == pytest.approx(-0.1)
        assert len(r.observations) == 1 and "error" in r.observations[0].lower()
    assert "search" in unknown.observations[0]
    assert many.calls == 2 and many.errors == 1 and many.observations[:2] == ["4", "4"]
    assert "limit of 2" in many.observations[2]


@pytest.mark.heavy
def test_python_calls_run_in_the_real_sandbox_and_the_next_episode_runs():
    cfg = load_config(None, ["multi_turn.tools=[python]", "sandbox.wall_time_s=2", "sandbox.cpu_time_s=1"])
    registry = ToolRegistry.from_config(cfg.multi_turn, cfg.sandbox, allow_custom_code=cfg.safety.allow_custom_code)
    responder = ToolTurns(ToolPool(registry, workers=2, timeout_s=20, max_output_chars=500),
                          max_calls_per_turn=1)
    try:
        py = ("python",)
        forever, secret = responder.respond([Turn(0, call("python", code="while True: pass"), py),
                                             Turn(1, call("python", code="print(open('/etc/shadow').read())"), py)])
        assert forever.errors == 1 and "error" in forever.observations[0]
        assert secret.errors == 1 and "root:" not in secret.observations[0]
        (after,) = responder.respond([Turn(2, call("python", code="print(6*7)"), py)])
        assert after.observations == ["42\n"] and after.errors == 0
    finally:
        responder.close()
