"""What the submitter writes and prints for split placement (issue 29): the plan's split line, one
srun step for every rank, a Slurm heterogeneous job from `--sbatch-script` (rollout nodes from
their own partition, first), and a clear refusal where submitit or a local run cannot do that."""
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from verl_hpc import submit
from verl_hpc.config import ConfigError, load_config
from verl_hpc.launcher import slurm
from verl_hpc.launcher.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
NO_FILES = ["--skip-model-check", "--skip-file-checks"]
# 1 rollout node from the partition 'inference' + 2 training nodes of 8 GPUs: 24 ranks
HET = ["placement.mode=split", "placement.rollout_nodes=1", "placement.rollout_partition=inference",
       "slurm.nodes=2", "slurm.partition=train", "slurm.constraint=h100", "slurm.account=proj",
       "slurm.mem_gb=500", "parallel.tp=4"]


@pytest.fixture
def on_login_node(monkeypatch):
    """Run from the checkout with sbatch 'on PATH', as the submitter would on a login node."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)


def test_plan_says_the_split_in_one_line(on_login_node, capsys):
    rc = submit.main(["configs/grpo_tiny_cpu.yaml", "--local", "--dry-run", *NO_FILES, "placement.mode=split",
                      "placement.rollout_ranks=1", "parallel.tp=1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "\n  split: 1 rollout rank (vLLM, tp 1) + 1 training rank (tp 1 pp 1 dp 1)\n" in out, out
    assert "rollout tp=1 (1 inference replica(s))" in out, out  # the rollout ranks' replicas, not the world's
    rc = submit.main(["configs/grpo_8b.yaml", "--dry-run", *NO_FILES, "placement.mode=split",
                      "placement.rollout_ranks=4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "  split: 4 rollout ranks (vLLM, tp 2) + 4 training ranks (tp 2 pp 1 dp 2)\n" in out, out
    assert "(2 inference replica(s))" in out and "[submit] memory plan (split): rollout group peak" in out, out


def blocks(text: str) -> list:
    """The #SBATCH options of each component, in order (a `hetjob` line starts the next one)."""
    out = [[]]
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            out.append([])
        elif line.startswith("#SBATCH"):
            (arg,) = shlex.split(line[len("#SBATCH"):])
            out[-1].append(arg)
    return out


def test_sbatch_script_of_a_heterogeneous_job(tmp_path, on_login_node, capsys):
    script = tmp_path / "job.sbatch"
    rc = submit.main(["configs/grpo_8b.yaml", "--sbatch-script", str(script), *NO_FILES, *HET])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "ranks: (1 rollout node(s) of partition 'inference' + 2 training node(s)) x 8 = 24" in out, out
    assert "split: 8 rollout ranks (vLLM, tp 2) + 16 training ranks (tp 4 pp 1 dp 4)" in out, out
    text = script.read_text()
    rollout, training = blocks(text)
    # component 0: the rollout nodes, and everything that belongs to the job as a whole
    assert {"--partition=inference", "--nodes=1", "--ntasks-per-node=8", "--gpus-per-node=8", "--mem=500GB",
            "--exclusive", "--job-name=grpo_8b", "--account=proj", "--requeue", "--signal=USR2@300",
            f"--output={tmp_path}/logs/%j_batch.out"} <= set(rollout), rollout
    assert not any(a.startswith("--constraint") for a in rollout)  # the training partition's features
    # component 1: the training nodes only
    assert sorted(training) == sorted(["--partition=train", "--nodes=2", "--ntasks-per-node=8",
                                       "--gpus-per-node=8", "--cpus-per-task=12", "--mem=500GB",
                                       "--constraint=h100", "--exclusive"]), training
    # one srun step over both components, every rank the same command on the resolved config, run
    # by the restart supervisor (slurm.max_restarts defaults on; a heterogeneous job has no spares)
    (line,) = [line for line in text.splitlines() if "verl_hpc/launcher/restart_loop.py" in line]
    supervisor = shlex.split(line)
    assert supervisor[supervisor.index("--spare-nodes") + 1] == "0", supervisor
    assert supervisor[supervisor.index("--nodes") + 1] == "3", supervisor  # both components' nodes
    argv = supervisor[supervisor.index("--") + 1:]
    assert argv[0] == "srun" and argv[1:4] == ["--het-group=0,1", "--mpi=pmix", "--kill-on-bad-exit=1"], argv
    assert argv[-4:] == ["-u", "-m", "verl_hpc.job", str(tmp_path / "config.yaml")], argv
    cfg = load_config(str(tmp_path / "config.yaml"), [])  # the ranks read the split from the config
    assert (cfg.world_size, cfg.rollout_world_size, cfg.placement.rollout_partition) == (24, 8, "inference")
    assert "PLACEMENT" not in text and "ROLLOUT" not in text  # no environment the runtime does not read
    # the script runs as bash: srun gets exactly those arguments
    record, tools = tmp_path / "srun.argv", tmp_path / "bin"
    tools.mkdir()
    (tools / "srun").write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {shlex.quote(str(record))}\n")
    (tools / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert record.read_text().split("\0")[:-1] == argv[1:]


def test_submitit_refuses_a_heterogeneous_job_and_names_the_way(on_login_node, capsys):
    cfg = load_config("configs/grpo_8b.yaml", HET)
    with pytest.raises(ConfigError):
        slurm.make_executor(make_plan(cfg, local=False), cfg)
    rc = submit.main(["configs/grpo_8b.yaml", "--dry-run", *NO_FILES, *HET])
    out, err = capsys.readouterr()
    assert rc == 2 and "#SBATCH" not in out, out
    assert err.startswith("error: placement.rollout_partition = 'inference' asks for a Slurm heterogeneous job, "
                          "which submitit cannot submit") and "--sbatch-script PATH" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_local_run_refuses_a_heterogeneous_job(on_login_node, capsys):
    rc = submit.main(["configs/grpo_tiny_cpu.yaml", "--local", "--dry-run", *NO_FILES, "parallel.tp=1",
                      "placement.mode=split", "placement.rollout_nodes=1", "placement.rollout_partition=inference",
                      "slurm.tasks_per_node=1"])
    out, err = capsys.readouterr()
    assert rc == 2 and "dry run" not in out, out
    assert err.startswith("error: placement.rollout_partition = 'inference' asks for a Slurm heterogeneous job; "
                          "a local run has one node") and err.count("\n") == 1, err
