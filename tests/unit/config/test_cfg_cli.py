"""`python -m verl_hpc.config`: exit codes, one-line errors on stderr, --print-config."""
import subprocess
import sys
from pathlib import Path

import yaml

from verl_hpc.config import load_config
from verl_hpc.config.__main__ import main


REPO = Path(__file__).resolve().parents[3]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "verl_hpc.config", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_bad_override_exits_2_with_one_line():
    run = cli("configs/smoke.yaml", "trainer.total_step=5")
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        "error: unknown config key 'trainer.total_step' (from command line 'trainer.total_step=5'): "
        "did you mean 'trainer.total_steps'?"]


def test_missing_file_exits_2_with_one_line():
    run = cli("configs/nope.yaml")
    assert (run.returncode, run.stderr) == (2, "error: config file not found: 'configs/nope.yaml'\n")


def test_print_config_is_the_resolved_yaml():
    run = cli("configs/smoke.yaml", "trainer.total_steps=7", "--print-config")
    assert run.returncode == 0, run.stderr
    printed = yaml.safe_load(run.stdout)
    assert printed["trainer"]["total_steps"] == 7
    assert printed["trainer"]["job"] == "smoke"
    assert printed["trainer"]["output_dir"] == "outputs/verl_hpc/smoke"  # resolved, not ${...}
    assert set(printed) == {"model", "data", "algorithm", "actor", "critic", "ref", "prm", "teacher", "lora", "rollout", "resharding", "reward", "multi_turn", "agent", "sandbox",
                            "trainer", "checkpoint", "parallel", "vision", "fsdp", "placement", "async_training", "slurm", "tracking",
                            "safety"}


def test_semantic_problems_go_to_stderr_and_exit_2(capsys):
    code = main([str(REPO / "configs/smoke.yaml"), "parallel.tp=3", "parallel.vpp=2"])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.splitlines()
    assert lines[0] == "error: 2 problems in the config:"
    assert "parallel.tp * parallel.pp = 3 * 1 = 3 does not divide the world size 2" in lines[1]
    assert "parallel.vpp = 2 needs parallel.pp > 1" in lines[2]


def test_model_check_and_its_switch(capsys):
    path = str(REPO / "configs/ppo_70b.yaml")
    assert main([path]) == 2
    assert "model.path: no such folder '/path/to/Meta-Llama-3-70B-Instruct'" in capsys.readouterr().err
    assert main([path, "--skip-model-check"]) == 0
    assert "tp=8 pp=2 dp=4" in capsys.readouterr().out


def test_overrides_without_a_file_and_unknown_options(capsys):
    assert main(["trainer.job=smoke", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["job"] == "smoke"
    assert main(["--frobnicate"]) == 2
    assert "unknown option '--frobnicate'" in capsys.readouterr().err
    assert main([str(REPO / "configs/smoke.yaml"), "stray"]) == 2
    assert "malformed override 'stray': expected key=value" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_print_config_output_loads_back_equal(tmp_path, capsys):
    assert main([str(REPO / "configs/grpo_8b.yaml"), "--print-config", "--skip-model-check"]) == 0
    dumped = tmp_path / "dump.yaml"
    dumped.write_text(capsys.readouterr().out)
    assert load_config(dumped) == load_config(REPO / "configs/grpo_8b.yaml")


def test_print_config_still_prints_when_semantic_checks_fail(capsys):
    assert main(["trainer.job=smoke", "parallel.tp=3", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["parallel"]["tp"] == 3
    assert err.startswith("error: parallel.tp * parallel.pp = 3")
