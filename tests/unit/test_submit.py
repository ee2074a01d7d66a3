"""The submitter's planning paths that submit nothing: dry runs, rendered scripts, refusals."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_hpc import submit
from verl_hpc.config import load_config
from verl_hpc.launcher import slurm
from verl_hpc.launcher.plan import make_plan

REPO = Path(__file__).resolve().parents[2]


def run_submit(monkeypatch, capsys, *args):
    """`python -m verl_hpc.submit ARGS` in this process (its main, as the program calls it; the program's
    own start-up is the dist and Slurm tiers' every launch): (exit code, stdout, stderr)."""
    monkeypatch.chdir(REPO)
    code = submit.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_plan_and_submitit_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)  # pretend Slurm is here
    rc = submit.main(["configs/grpo_8b.yaml", "--dry-run", "--skip-model-check", "--skip-file-checks",
                      f"slurm.log_dir={tmp_path}/%j", "slurm.partition=gpu", "slurm.account=proj1",
                      "slurm.env.NCCL_IB_TIMEOUT=23"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "on slurm" in out and "tp=2" in out
    for line in ["#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj1", "#SBATCH --requeue", "#SBATCH --signal=USR2@",
                 "--mpi=pmix", "--kill-on-bad-exit=1", "export NCCL_IB_TIMEOUT=23",
                 "export CUDA_DEVICE_MAX_CONNECTIONS=1"]:
        assert line in out, line


def test_print_config_prints_and_submits_nothing(tmp_path, monkeypatch, capsys):
    """A look before the queue: the plan and resolved YAML, exit 0, no submission or local ranks."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)  # pretend Slurm is here
    started = []
    monkeypatch.setattr(slurm, "submit", lambda *a, **k: started.append("slurm"), raising=False)
    monkeypatch.setattr("verl_hpc.launcher.local.run_local", lambda *a, **k: started.append("local"))
    for extra in ([], ["--local"]):
        rc = submit.main(["configs/grpo_8b.yaml", "--print-config", "--skip-model-check", "--skip-file-checks",
                          f"slurm.log_dir={tmp_path}/%j", *extra])
        out = capsys.readouterr().out
        assert rc == 0 and "trainer:" in out and "parallel:" in out, out[-500:]
        assert "submitted" not in out
    assert started == []
    assert not any(tmp_path.iterdir())  # no job folder, no resolved config written


def test_submitit_private_script_hook_still_exists():
    # slurm.sbatch_text relies on submitit internals; a new submitit release must fail here first
    cfg = load_config("configs/smoke.yaml", [])
    ex = slurm.make_executor(make_plan(cfg, local=False), cfg)
    text = slurm.sbatch_text(ex)
    assert text.startswith("#!/bin/bash") and "submitit.core._submit" in text


@pytest.mark.parametrize("runtime,needle", [
    ("apptainer", "apptainer exec --bind /scratch /img/verl.sif python -u -m verl_hpc.job"),
    ("pyxis", "--container-image=nvcr.io/me/verl:1 --container-mounts=/scratch"),
    ("charliecloud", f"ch-run --bind={REPO} --bind=/scratch --cd={REPO} verl_hpc:cpu -- python -u -m verl_hpc.job"),
    ("none", f"{sys.executable} -u -m verl_hpc.job"),
])
def test_sbatch_script_container_flags(tmp_path, monkeypatch, capsys, runtime, needle):
    image = {"apptainer": "/img/verl.sif", "charliecloud": "verl_hpc:cpu"}.get(runtime, "nvcr.io/me/verl:1")
    script = tmp_path / "job.sbatch"
    code, _, err = run_submit(monkeypatch, capsys, "configs/smoke.yaml", "--sbatch-script", str(script),
                              f"slurm.container.runtime={runtime}", f"slurm.container.image={image}",
                              "slurm.container.mounts=[/scratch]")
    assert code == 0, err
    text = script.read_text()
    assert needle in text, text
    if runtime == "charliecloud":  # mount points made in the image before srun; PMIx without shm
        assert f'mkdir -p "${{CH_IMAGE_STORAGE:-/var/tmp/$USER.ch}}"/img/verl_hpc+cpu{REPO}' in text, text
        assert "export PMIX_MCA_gds=hash" in text and 'export USER="${USER:-$(id -un)}"' in text
        assert text.index("mkdir -p") < text.index("srun --mpi=pmix")
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "logs").is_dir()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.parametrize("args,words", [
    (["parallel.tp=3"], ["parallel.tp", "world size"]),
    (["trainer.total_step=5"], ["trainer.total_steps"]),
    (["slurm.nodes=2", "--local"], ["slurm.nodes=2", "local run has one node"]),
    (["slurm.tasks_per_node=8", "slurm.gpus_per_node=4"], ["slurm.tasks_per_node", "GPU"]),
])
def test_impossible_jobs_are_refused_before_submission(monkeypatch, capsys, args, words):
    code, out, err = run_submit(monkeypatch, capsys, "configs/smoke.yaml", "--dry-run", *args)
    assert code == 2, out + err
    err = err.strip()
    assert err.startswith("error: ") and "Traceback" not in err
    for w in words:
        assert w in err, err


def test_submitit_script_runs_ranks_in_charliecloud():
    # The Python submitter's script: every rank's interpreter is the container's, behind ch-run.
    cfg = load_config("configs/smoke.yaml", ["slurm.container.runtime=charliecloud",
                                             "slurm.container.image=verl_hpc:cpu"])
    text = slurm.sbatch_text(slurm.make_executor(make_plan(cfg, local=False), cfg))
    cwd = os.getcwd()
    assert f"ch-run --bind={cwd} --cd={cwd} verl_hpc:cpu -- python -u -m submitit.core._submit" in text
    assert f"/img/verl_hpc+cpu{cwd}" in text and "--mpi=pmix" in text
