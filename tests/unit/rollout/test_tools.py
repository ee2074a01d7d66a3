"""Tool calls, the built-in tools, the registry and the pool (verl_hpc/rollout/tools)."""
import os
import random
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from verl_hpc.config import load_config
from verl_hpc.config.errors import ConfigError
from verl_hpc.config.schema import choices_of
from verl_hpc.rollout.tools import (ToolCall, ToolFailed, ToolPool, ToolRegistry, calculator, has_tool_call,
                                    load_environment, parse_tool_calls, run_python)
from verl_hpc.rollout.tools.builtin import BUILTINS
from verl_hpc.rollout.tools.registry import Tool

EXAMPLE = "user_tools_example"  # tests/unit/rollout/user_tools_example.py, on the tests' path


# ------------------------------------------------------------------------------ parsing
def test_parses_calls_and_ignores_the_text_around_them():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12345 * 67890"}}'
            '</tool_call> and then\n<tool_call>\n{"name": "python",\n "arguments": "{\\"code\\": \\"print(1)\\"}"}\n'
            '</tool_call>\nDone.')
    parsed = parse_tool_calls(text)
    assert parsed.errors == []
    assert parsed.calls == [ToolCall("calculator", {"expression": "12345 * 67890"}),
                            ToolCall("python", {"code": "print(1)"})]  # arguments as a JSON string
    assert has_tool_call(text) and not has_tool_call("The answer is 42.")
    assert parse_tool_calls("The answer is 42.").calls == []


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator" "arguments": {}}', "invalid JSON (Expecting ',' delimiter at char 22)"),
    ('["calculator"]', 'expected a JSON object {"name": ..., "arguments": {...}}, got an array'),
    ('{"arguments": {"expression": "1"}}', 'no "name" (the tool\'s name, a string)'),
    ('{"name": "", "arguments": {}}', 'no "name" (the tool\'s name, a string)'),
    ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" must be a JSON object, got an array'),
    ('{"name": "calculator", "arguments": "1 + 2"}',
     '"arguments" must be a JSON object, got a string that is not a JSON object'),
    # what Python's JSON reader refuses with a RecursionError or a ValueError, not a JSONDecodeError
    ('{"name": "f", "arguments": {"x": ' + "[" * 100000 + "]" * 100000 + "}}", "invalid JSON (nested too deeply)"),
    ('{"name": "f", "arguments": {"x": -' + "9" * 4301 + "}}", "invalid JSON (an integer of 4301 digits; at most 4300)"),
    ('{"name": "f", "arguments": "{\\"x\\": ' + "9" * 5000 + '}"}',
     '"arguments" must be a JSON object, got a string that is not a JSON object'),
])
def test_a_malformed_call_is_an_error_the_model_reads(body, error):
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    parsed = parse_tool_calls(f"{good} then <tool_call>{body}</tool_call>")
    assert parsed.calls == [ToolCall("calculator", {"expression": "2"})]
    assert parsed.errors == [f"error: tool call 2: {error}"]


def test_an_unclosed_call_at_the_end_of_a_turn_is_an_error():
    parsed = parse_tool_calls('<tool_call>{"name": "calculator"}</tool_call> <tool_call>{"name": "calc')
    assert parsed.calls == [ToolCall("calculator", {})]  # a call without arguments has none
    assert parsed.errors == ["error: tool call 2: <tool_call> is not closed by </tool_call>"]


# ------------------------------------------------------------------------------ calculator
def test_calculator_is_exact_on_products_of_five_digit_numbers():
    rng = random.Random(30)
    for _ in range(200):
        a, b = rng.randrange(10000, 100000), rng.randrange(10000, 100000)
        assert calculator(f"{a} * {b}") == str(a * b)


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("2 ** 3 ** 2", "512"), ("-2 ** 2", "-4"), ("7 / 2", "3.5"),
    ("7 // 2", "3"), ("-7 % 3", "2"), ("+-+-3", "3"), ("0.1 + 0.2", "0.30000000000000004"), ("2 ** -1", "0.5"),
    ("99999 ** 200", str(99999 ** 200)),
])
def test_calculator_follows_python_precedence_and_prints_ints_exactly(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error, message", [
    ("1 / 0", ZeroDivisionError, "division by zero"),
    ("5 % 0", ZeroDivisionError, "division by zero"),
    ("0 ** -1", ZeroDivisionError, "zero to a negative power"),
    ("x + 1", ValueError, "the name 'x' is not allowed"),
    ("__import__('os')", ValueError, "a function call is not allowed"),
    ("3 ^ 2", ValueError, r"\^ \(use \*\* for powers\) is not allowed"),
    ("2 +", ValueError, "not an arithmetic expression"),
    ("1e308 * 10", ValueError, "not a finite number"),
    ("(-8) ** 0.5", ValueError, "not a real number"),
    ("1" * 1001, ValueError, "the limit is 1000"),
])
def test_calculator_errors(expression, error, message):
    with pytest.raises(error, match=message):
        calculator(expression)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "2 ** (10 ** 999)", "10 ** 600 * 10 ** 600", "2.0 ** 10000"])
def test_calculator_refuses_huge_results_at_once(expression):
    start = time.monotonic()
    with pytest.raises(ValueError, match="digits|too large"):
        calculator(expression)
    assert time.monotonic() - start < 0.5


# ------------------------------------------------------------------------------ python tool
@dataclass
class FakeResult:  # the sandbox's SandboxResult, as far as the tool reads it
    stdout: str
    stderr: str = ""
    exit_code: Optional[int] = 0
    status: str = "ok"

    @property
    def ok(self):
        return self.status == "ok"


class FakeSandbox:
    def __init__(self, result):
        self.result, self.codes = result, []

    def run_python(self, code, *, wall_time_s=None):
        self.codes.append(code)
        return self.result


def test_python_tool_returns_stdout_or_the_verdict_and_the_end_of_stderr():
    sandbox = FakeSandbox(FakeResult("838102050\n"))
    assert run_python("print(12345 * 67890)", sandbox) == "838102050\n"
    assert sandbox.codes == ["print(12345 * 67890)"]
    trace = "\n".join(f"line {i}" for i in range(20)) + "\nZeroDivisionError: division by zero\n"
    with pytest.raises(ToolFailed) as e:
        run_python("print(1); 1/0", FakeSandbox(FakeResult("1\n", trace, 1, "error")))
    assert str(e.value) == ("1\nerror: error (exit code 1)\n"
                            "line 15\nline 16\nline 17\nline 18\nline 19\nZeroDivisionError: division by zero")
    with pytest.raises(ToolFailed, match="^error: memory limit$"):
        run_python("x = ' ' * 10**12", FakeSandbox(FakeResult("", "", None, "memory_limit")))


def test_the_registry_builds_the_sandbox_on_first_use_only(tmp_path):
    built = []

    def factory():
        built.append(1)
        return FakeSandbox(FakeResult("3\n"))

    registry = registry_of(load_config(None, []), sandbox_factory=factory)
    assert registry.names() == ["calculator", "python"] and built == []
    with ToolPool(registry, workers=2, timeout_s=5, max_output_chars=100) as pool:
        outcomes = pool.run([(["python"], ToolCall("python", {"code": "print(1 + 2)"}))] * 3)
    assert [o.text for o in outcomes] == ["3\n"] * 3 and built == [1]
    failing = registry_of(load_config(None, []),
                          sandbox_factory=lambda: FakeSandbox(FakeResult("", "Boom\n", 1, "error")))
    with ToolPool(failing, workers=1, timeout_s=5, max_output_chars=100) as pool:
        out, = pool.run([(["python"], ToolCall("python", {"code": "raise Boom"}))])
    assert (out.ok, out.error, out.text) == (False, "tool_error", "error: error (exit code 1)\nBoom")


# ------------------------------------------------------------------------------ registry
def config(*overrides):
    return load_config(None, list(overrides))


def registry_of(cfg, **kwargs):
    """The registry of a job config's multi_turn, sandbox and safety sections."""
    return ToolRegistry.from_config(cfg.multi_turn, cfg.sandbox, allow_custom_code=cfg.safety.allow_custom_code,
                                    **kwargs)


def test_the_built_in_tools_are_the_configs_choices():
    assert set(BUILTINS) == set(choices_of("multi_turn.tools"))


def test_registry_names_schemas_and_offered_lists():
    registry = registry_of(config("multi_turn.tools=[calculator]"))
    assert registry.names() == ["calculator"]
    schema, = registry.schemas(["calculator"])
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert "12345 * 67890" in schema["function"]["parameters"]["properties"]["expression"]["description"]
    assert registry.check_offered(["calculator"]) is None and registry.check_offered([]) is None
    assert registry.check_offered(["calculater"]) == ("unknown tool 'calculater'; valid: calculator "
                                                      "(did you mean 'calculator'?)")
    assert registry.check_offered(["python"]) == "unknown tool 'python'; valid: calculator"
    assert registry.check_offered("calculator") == "tools must be a list of tool names, got 'calculator'"


def test_user_tools_need_the_custom_code_switch():
    with pytest.raises(ConfigError) as e:
        registry_of(config(f"multi_turn.user_tools=[{EXAMPLE}:word_count]"))
    assert str(e.value) == ("multi_turn.user_tools runs your own code: set safety.allow_custom_code=true "
                            "to allow it")
    with pytest.raises(ConfigError, match="^multi_turn.environment runs your own code"):
        load_environment(f"{EXAMPLE}:Guess", allow_custom_code=False)


def test_a_user_tool_is_offered_described_and_called():
    registry = registry_of(config("multi_turn.tools=[calculator]", "safety.allow_custom_code=true",
                                  f"multi_turn.user_tools=[{EXAMPLE}:word_count]"))
    assert registry.names() == ["calculator", "word_count"]
    schema = registry.schemas(["word_count"])[0]["function"]
    assert schema["name"] == "word_count" and schema["description"] == "Count the words of a text."
    with ToolPool(registry, workers=1, timeout_s=5, max_output_chars=100) as pool:
        out, = pool.run([(["word_count"], ToolCall("word_count", {"text": "one two three"}))])
    assert (out.ok, out.text, out.error, out.name) == (True, "3", None, "word_count")


def test_a_user_tool_that_cannot_be_loaded_or_described_is_one_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "broken_tools_30.py").write_text(textwrap.dedent("""
        import json

        SETTINGS = json.loads("{not json")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [("broken_tools_30:f", "multi_turn.user_tools = 'broken_tools_30:f': importing module 'broken_tools_30' "
                                   f"failed at {tmp_path / 'broken_tools_30.py'}, line 4: JSONDecodeError: "),
             ("nowhere_30:f", "multi_turn.user_tools = 'nowhere_30:f': cannot import module 'nowhere_30'"),
             (f"{EXAMPLE}:missing", f"multi_turn.user_tools = '{EXAMPLE}:missing': module '{EXAMPLE}' has no "
                                    "function 'missing'; callables there: "),
             (f"{EXAMPLE}:undocumented", f"multi_turn.user_tools = '{EXAMPLE}:undocumented': cannot describe it "
                                         "to the model (Cannot generate JSON schema for undocumented because it has no docstring!)")]
    for spec, message in cases:
        with pytest.raises(ConfigError) as e:
            registry_of(config("safety.allow_custom_code=true", f"multi_turn.user_tools=[{spec}]"))
        assert str(e.value).startswith(message), str(e.value)
        assert "\n" not in str(e.value)


def test_environments_load_and_follow_the_protocol():
    registry = registry_of(config("safety.allow_custom_code=true",
                                  f"multi_turn.environment={EXAMPLE}:Guess"))
    env = registry.environment()
    assert env.reset({"prompt": "guess"}) == "Guess a number from 1 to 10."
    assert env.step("3") == ("higher", 0.0, False) and env.step("7") == ("right", 1.0, True)
    with pytest.raises(ConfigError, match=r"expected a class with reset\(row\) and step\(turn_text\); missing: step"):
        load_environment(f"{EXAMPLE}:NoStep", allow_custom_code=True)
    with pytest.raises(ConfigError, match="it is not a class"):
        load_environment(f"{EXAMPLE}:word_count", allow_custom_code=True)


# ------------------------------------------------------------------------------ pool
def boom(x: int) -> str:
    return str(1 // x)


def leave():
    raise SystemExit(3)


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return f"slept {seconds}"


def chatty(n: int) -> str:
    return "x" * n


def pool_of(workers=4, timeout_s=5.0, max_output_chars=120):
    tools = [Tool(f.__name__, f, {}) for f in (boom, leave, nap, chatty)] + [Tool("number", lambda: 42, {})]
    return ToolPool(ToolRegistry(tools), workers=workers, timeout_s=timeout_s, max_output_chars=max_output_chars)


ALL = ["boom", "leave", "nap", "chatty", "number"]


def test_calls_run_at_once():
    with pool_of(workers=4) as pool:
        start = time.monotonic()
        outcomes = pool.run([(ALL, ToolCall("nap", {"seconds": 0.5}))] * 4)
        took = time.monotonic() - start
    assert [o.text for o in outcomes] == ["slept 0.5"] * 4 and all(o.ok for o in outcomes)
    assert took < 1.2, f"4 calls of 0.5 s on 4 workers took {took:.2f} s"  # one after another: 2 s
    assert all(0.45 < o.seconds < 1.2 for o in outcomes)


def test_a_call_past_the_limit_is_abandoned_and_the_pool_goes_on():
    with pool_of(workers=1, timeout_s=0.3) as pool:
        start = time.monotonic()
        slow, quick = pool.run([(ALL, ToolCall("nap", {"seconds": 30})), (ALL, ToolCall("nap", {"seconds": 0}))])
        assert time.monotonic() - start < 2
        assert (slow.ok, slow.error, slow.text) == (False, "timeout", "error: nap did not finish within 0.3 s "
                                                                     "and was abandoned")
        assert quick.ok and pool.abandoned_running == 1  # the call behind it ran on a fresh worker
        assert pool.run([(ALL, ToolCall("number", {}))])[0].text == "42"


def test_failures_become_observations():
    calls = [(ALL, ToolCall("boom", {"x": 0})), (ALL, ToolCall("leave", {})),
             (ALL, ToolCall("boom", {"y": 1})), (ALL, ToolCall("shell", {"cmd": "ls"})),
             (["number"], ToolCall("boom", {"x": 1})), (ALL, ToolCall("chatty", {"n": 150})),
             (ALL, ToolCall("number", {}))]
    with pool_of() as pool:
        got = [(o.ok, o.error, o.text) for o in pool.run(calls)]
    assert got == [
        (False, "tool_error", "error: ZeroDivisionError: integer division or modulo by zero"),
        (False, "tool_error", "error: SystemExit: 3"),
        (False, "bad_arguments", "error: bad arguments for boom: missing a required argument: 'x'; "
                                 "expected boom(x: int) -> str"),
        (False, "unknown_tool", "error: unknown tool 'shell'; tools offered: " + ", ".join(ALL)),
        (False, "not_offered", "error: tool 'boom' is not offered here; tools offered: number"),
        (True, None, "x" * 120 + "\n[output cut: 30 more characters not shown]"),
        (True, None, "42"),  # not a string: str()'d
    ]


def test_pool_from_config_uses_the_cores_the_rank_leaves_free():
    registry = registry_of(config("multi_turn.tools=[calculator]"))
    job = config("slurm.cpus_per_task=4", "multi_turn.tool_timeout_s=3")
    with ToolPool.from_config(job.multi_turn, registry, cpus_per_task=job.slurm.cpus_per_task) as pool:
        assert (pool.workers, pool.timeout_s, pool.max_output_chars) == (3, 3.0, 2000)
        out, = pool.run([(["calculator"], ToolCall("calculator", {"expression": "12345 * 67890"}))])
    assert out.text == "838102050"


@pytest.mark.heavy
def test_an_abandoned_call_does_not_keep_the_rank_from_exiting():
    script = textwrap.dedent("""
        import time
        from verl_hpc.rollout.tools import ToolCall, ToolPool, ToolRegistry
        from verl_hpc.rollout.tools.registry import Tool

        pool = ToolPool(ToolRegistry([Tool("hang", lambda: time.sleep(3600), {})]), 1, 0.1, 100)
        print(pool.run([(["hang"], ToolCall("hang", {}))])[0].error, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert (done.returncode, done.stdout) == (0, "timeout\n"), done.stderr
