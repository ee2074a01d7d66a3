"""The agent section: its checks name the field and what would be valid."""
import functools

import pytest

from verl_hpc.config import load_config
from verl_hpc.trainer.roles import rollout_options

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "rollout.n=2",
        "agent.enable=true", "agent.function=my.agents:solve", "safety.allow_custom_code=true"]


problems = functools.partial(config_checks.refused, base=BASE)


@pytest.mark.parametrize("overrides, wanted", [
    (["safety.allow_custom_code=false"], "agent.function runs your own code: set safety.allow_custom_code"),
    (["agent.function=nocolon"], "agent.function: 'nocolon' is not 'package.module:function'"),
    (["multi_turn.enable=true"], "agent.enable and multi_turn.enable both drive the episodes"),
    (["rollout.tp=2", "slurm.tasks_per_node=2"], "agent.enable needs rollout.tp = 1"),
    (["placement.mode=split", "placement.rollout_ranks=1"], "agent.enable does not run with placement.mode = split"),
    (["algorithm.adv_estimator=remax", "rollout.n=1"], "does not run algorithm.adv_estimator = remax"),
    (["agent.timeout_s=1e9"], "agent.timeout_s is capped at one week"),
    (["agent.concurrency=0"], "agent.concurrency: must be in [1, 1024], got 0"),
    (["agent.port=70000"], "agent.port: must be in [0, 65535], got 70000"),
    (["agent.port=8000", "slurm.tasks_per_node=2"], "the ranks of a node would all listen on that port"),
    (["agent.command=python3 agent.py"], "agent.function and agent.command both name the default agent"),
    (["agent.function=", "agent.command=python3 agent.py", "safety.allow_custom_code=false"],
     "agent.command runs your own code: set safety.allow_custom_code"),
    (["agent.function=", "agent.command='  '"], "agent.command is blank"),
    (["agent.read_only_paths=[/opt/env,agents]"], "agent.read_only_paths[1]: 'agents' is not an absolute path"),
    # a program that is not there: every run would end in exit 127, after the queue
    (["agent.function=", "agent.command=/nonexistent/env/bin/python solve.py"],
     "agent.command: the program '/nonexistent/env/bin/python' does not exist on this node"),
    (["agent.function=", "agent.command='OPENAI_X=1 no-such-agent-program --go'"],
     "agent.command: the program 'no-such-agent-program' is not on the sandbox's PATH"),
    (["agent.function=", "agent.command=./solve.sh"], "agent.command: the program './solve.sh' is a relative path"),
    (["agent.function=", "agent.command='python3 \"unclosed'"], "agent.command: 'python3 \"unclosed' is not a shell"),
])
def test_checks_name_the_field(overrides, wanted):
    found = problems(*overrides)
    assert any(wanted in p for p in found), found


@pytest.mark.parametrize("command", ["python3 -c 'print(1)'", "/bin/sh -c true", "A=1 python3 x.py",
                                     "cd /tmp && python3 x.py", "$HOME/bin/agent"])
def test_a_command_whose_program_is_there_or_cannot_be_told_is_accepted(command):
    cfg = load_config(None, [*BASE, "agent.function=", f"agent.command={command}"])
    assert not [p for p in cfg.agent.check(cfg) if "agent.command" in p]


def test_the_engine_window_spans_the_whole_agent_run():
    cfg = load_config(None, [*BASE, "data.max_response_length=96", "rollout.max_tokens=16"])
    assert rollout_options(cfg).window == 96  # later calls carry the conversation so far


def test_a_data_source_without_a_reward_function_is_accepted_when_the_agents_give_the_reward(tmp_path):
    import json

    from verl_hpc.launcher.preflight_data import data_problems

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"task {i}", "data_source": "my_agent_task", "ground_truth": "x"})
                            + "\n" for i in range(4)))
    base = [*BASE, f"data.train_files=[{rows}]", "data.val_files=[]", "data.train_batch_size=4"]
    assert data_problems(load_config(None, base)) == []
    without = [p for p in data_problems(load_config(None, [*base, "agent.enable=false"])) if "my_agent_task" in p]
    assert without and "no reward function for data_source 'my_agent_task'" in without[0]
