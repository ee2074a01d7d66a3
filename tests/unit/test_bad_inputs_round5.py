"""Bad inputs accepted before the queue and refused only after it (issue 83, item 6): an unknown
data.mixture source, a missing agent.read_only_paths folder, an agent.function whose module does
not import, an agent.command that is only a comment. `python -m verl_hpc.submit ... --dry-run`
refuses each in one line naming the field and what is valid, with the very check (and words) the
rank runs at its start."""
import json

import pytest

from verl_hpc import submit
from verl_hpc.config import ConfigError, load_config, validate

ROW = {"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"}


@pytest.fixture
def job(tmp_path):
    """An RL job's rows (no model read: --skip-model-check) and an agent module on a folder that
    only slurm.env's PYTHONPATH names; returns (overrides, agent overrides)."""
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps(dict(ROW, prompt=f"{i}+2?")) + "\n" for i in range(8)))
    code = tmp_path / "agent_code"
    code.mkdir()
    (code / "my_agents.py").write_text("def solve(row, client):\n    return 1.0\n")
    (code / "broken_agents.py").write_text("def solve(row, client:\n    return 1.0\n")
    base = ["trainer.job=rl", "model.path=/nonexistent/model", f"data.train_files=[{rows}]", "data.val_files=[]",
            "rollout.n=2", "slurm.tasks_per_node=1", f"trainer.output_dir={tmp_path}/out",
            f"slurm.log_dir={tmp_path}/logs/%j"]
    agent = ["agent.enable=true", "agent.function=my_agents:solve", "safety.allow_custom_code=true",
             f"slurm.env.PYTHONPATH={code}"]
    return base, agent


def dry_run(capsys, overrides):
    """(exit code, the last stderr line) of `python -m verl_hpc.submit --local --dry-run`."""
    code = submit.main([*overrides, "--local", "--dry-run", "--skip-model-check"])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_the_good_jobs_pass(job, capsys):
    base, agent = job
    for overrides in (base, [*base, "data.mixture={gsm8k: 1.0}"], [*base, *agent],
                      [*base, *agent, "agent.read_only_paths=[/usr/lib]"]):
        code, err = dry_run(capsys, overrides)
        assert code == 0 and not err, (overrides, err)


def test_a_mixture_source_the_rows_lack(job, capsys):
    base, _ = job
    code, err = dry_run(capsys, [*base, "data.mixture={gsm8k: 1.0, gsm8kk: 1.0}"])
    line = "data.mixture: ['gsm8kk'] not among the train set's data_source values; valid: ['gsm8k']"
    assert (code, err) == (2, [f"error: {line}"])
    from verl_hpc.data.errors import DataError
    from verl_hpc.data.sampler import MixtureSampler

    with pytest.raises(DataError) as e:  # what the job's sampler says at its start
        MixtureSampler({"gsm8k": list(range(8))}, {"gsm8k": 1.0, "gsm8kk": 1.0}, 0, True, "fp")
    assert str(e.value) == line


def test_a_mixture_without_a_weight_for_a_source(job, tmp_path, capsys):
    base, _ = job
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps(dict(ROW, data_source="openai/gsm8k")) + "\n")
    base = [o for o in base if not o.startswith("data.train_files")] + [
        f"data.train_files=[{tmp_path}/train.jsonl, {more}]"]
    code, err = dry_run(capsys, [*base, "data.mixture={gsm8k: 1.0}"])
    assert (code, err) == (2, ["error: data.mixture: no weight for data_source ['openai/gsm8k']; give every source "
                               "of the train set a weight (0 leaves it out): ['gsm8k', 'openai/gsm8k']"])


def test_a_read_only_path_missing_on_this_node(job, capsys):
    base, agent = job
    code, err = dry_run(capsys, [*base, *agent, "agent.read_only_paths=[/usr/lib, /nonexistent/agent_env]"])
    line = ("agent.read_only_paths[1]: '/nonexistent/agent_env' does not exist on this node; valid: a folder "
            "(or file) present on every node of the job")
    assert (code, err) == (2, [f"error: {line}"])
    from verl_hpc.rollout.agents.command import check_read_only

    with pytest.raises(ConfigError) as e:  # what the rank says before it starts the agents' endpoint
        check_read_only(["/usr/lib", "/nonexistent/agent_env"])
    assert str(e.value) == line


@pytest.mark.parametrize("function, line", [
    ("nowhere_83:solve", "agent.function = 'nowhere_83:solve': cannot import module 'nowhere_83' (No module named "
                         "'nowhere_83'); valid: a module on PYTHONPATH on every node"),
    ("my_agents.tools:solve", "agent.function = 'my_agents.tools:solve': cannot import module 'my_agents.tools' (No "
                              "module named 'my_agents.tools'; 'my_agents' is not a package); valid: a module on "
                              "PYTHONPATH on every node"),
    ("broken_agents:solve", "agent.function = 'broken_agents:solve': importing module 'broken_agents' failed at "
                            "{code}/broken_agents.py, line 1: SyntaxError: "),
])
def test_an_agent_function_whose_module_does_not_import(job, tmp_path, capsys, monkeypatch, function, line):
    base, agent = job
    line = line.format(code=tmp_path / "agent_code")
    code, err = dry_run(capsys, [*base, *agent, f"agent.function={function}"])
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {line}"), err
    from verl_hpc.rewards import RewardError
    from verl_hpc.rewards.custom import load_user_object

    monkeypatch.syspath_prepend(str(tmp_path / "agent_code"))  # the rank's PYTHONPATH
    with pytest.raises(RewardError) as e:  # what the rank says when it loads the agent
        load_user_object("agent.function", function, RewardError)
    assert f"error: {e.value}" == err[0]


def test_the_submitter_finds_a_module_without_running_any_of_its_code(tmp_path):
    """The login node runs no user code: a package whose __init__ would fail (or do anything) is
    not imported to find a module inside it."""
    import sys

    from verl_hpc.rewards.custom import module_problem

    pkg = tmp_path / "agents_pkg_83"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\nraise SystemExit(3)\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "run.py").write_text("import not_installed_anywhere\ndef solve(row, client): ...\n")
    assert module_problem("agent.function", "agents_pkg_83.sub.run:solve", [str(tmp_path)]) == ""
    assert "No module named 'agents_pkg_83.sub.nope'" in module_problem(
        "agent.function", "agents_pkg_83.sub.nope:solve", [str(tmp_path)])
    assert not (tmp_path / "ran").exists() and "agents_pkg_83" not in sys.modules


@pytest.mark.parametrize("command", ["# run my agent", "  # python3 /opt/agent.py"])
def test_an_agent_command_that_is_only_a_comment(job, capsys, command):
    base, agent = job
    overrides = [*base, *[a for a in agent if not a.startswith("agent.function")], "agent.function=",
                 f"agent.command={command}"]
    code, err = dry_run(capsys, overrides)
    line = (f"agent.command: {command!r} is only a comment: it runs nothing; valid: a command line whose last "
            "line of output is the reward")
    assert (code, err) == (2, [f"error: {line}"])
    with pytest.raises(ConfigError) as e:  # every rank validates its config again first (job.py)
        validate(load_config(None, overrides), check_model=False)
    assert str(e.value) == line
