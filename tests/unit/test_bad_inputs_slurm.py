"""Bad inputs that reach a Slurm script (issue 28): values that a shell would run, values sbatch
would read differently, and the standalone `--sbatch-script` against the submitit script."""
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from verl_hpc import submit
from verl_hpc.config import load_config
from verl_hpc.launcher import slurm
from verl_hpc.launcher.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
IMAGES = {"apptainer": "/x.sif", "pyxis": "nvcr.io/me/verl:1", "charliecloud": "verl_hpc:cpu"}


@pytest.fixture
def on_login_node(monkeypatch):
    """Run from the checkout with sbatch 'on PATH', as the submitter would on a login node."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)


def standalone_script(folder: Path, overrides, capsys) -> str:
    script = folder / "job.sbatch"
    rc = submit.main(["configs/smoke.yaml", "--sbatch-script", str(script), *overrides])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    return script.read_text()


def submitit_script(overrides) -> str:
    cfg = load_config("configs/smoke.yaml", overrides)
    return slurm.sbatch_text(slurm.make_executor(make_plan(cfg, local=False), cfg))


def fake_bin(folder: Path, record: Path) -> Path:
    """srun and the container runtimes as scripts that only write their argv, NUL-separated."""
    folder.mkdir()
    for name in ("srun", "apptainer", "ch-run"):
        tool = folder / name
        tool.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {shlex.quote(str(record))}\n")
        tool.chmod(0o755)
    return folder


# ------------------------------------------------------------------ 1. shell injection
@pytest.mark.parametrize("writer", ["standalone", "submitit"])
@pytest.mark.parametrize("runtime", ["apptainer", "pyxis", "charliecloud"])
def test_container_values_reach_srun_as_literal_arguments(tmp_path, on_login_node, capsys, runtime, writer):
    pwned = tmp_path / "pwned"
    payload, mount = f"--bind $(touch {pwned})", f"/data:/data;touch {pwned}"
    overrides = [f"slurm.container.runtime={runtime}", f"slurm.container.image={IMAGES[runtime]}",
                 f"slurm.container.extra_args=['{payload}']", f"slurm.container.mounts=['{mount}']"]
    text = (standalone_script(tmp_path, overrides, capsys) if writer == "standalone"
            else submitit_script(overrides))
    record = tmp_path / "srun.argv"
    env = dict(os.environ, PATH=f"{fake_bin(tmp_path / 'bin', record)}:{os.environ['PATH']}",
               CH_IMAGE_STORAGE=str(tmp_path / "ch"))  # charliecloud's mkdir lines stay in tmp_path
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not pwned.exists(), f"the {writer} script ran the payload"
    argv = record.read_text().split("\0")[:-1]
    assert payload in argv, argv  # one argument, as written
    assert any(mount in arg for arg in argv), argv


# ------------------------------------------------------------------ 2. the same job from both writers
AWKWARD = ["slurm.job_name=\"my run; $(id) 'q' \\\"dq\\\" #3\"", "slurm.partition=\"gpu part\"",
           "slurm.account=\"acc\tx$HOME\"", "slurm.qos=\"a`b`\"", "slurm.constraint=\"x&y|z\"",
           "slurm.mem_gb=16", "slurm.exclusive=true", "slurm.additional={reservation: 'my res', mail_type: END}",
           "slurm.env.NCCL_IB_HCA='mlx5 $x'", "slurm.setup=['module load cuda']"]
CONTAINERS = {"none": [], "apptainer": ["slurm.container.extra_args=['--cleanenv', '--bind /a b:/c']",
                                        "slurm.container.mounts=['/s p:/s']"],
              "pyxis": ["slurm.container.extra_args=['--container-workdir=/w d']",
                        "slurm.container.mounts=['/s p:/s', /t]"],
              "charliecloud": ["slurm.container.extra_args=['--set-env=A=b c']", "slurm.container.mounts=['/s p']"]}
# What the two scripts legitimately do differently: submitit keeps its own log names and
# bookkeeping options, and its ranks run submitit's entry point on a pickle instead of verl_hpc.job.
SUBMITIT_ONLY = ("--open-mode", "--wckey")
LOG_OPTIONS = ("--output", "--error")


def sbatch_options(text: str) -> set:
    """The #SBATCH options as sbatch reads them: its parser splits on blanks outside quotes."""
    found = set()
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            (arg,) = shlex.split(line[len("#SBATCH"):])
            if not arg.startswith(LOG_OPTIONS + SUBMITIT_ONLY):
                found.add(arg)
    return found


def srun_line(text: str) -> tuple:
    """(what runs srun: the restart supervisor up to its `--`, srun's own argv) of the script's one srun line."""
    (line,) = [line for line in text.splitlines() if line.startswith("srun ") or " -- srun " in line]
    argv = shlex.split(line)
    return argv[:argv.index("srun")], argv[argv.index("srun"):]


def srun_argv(text: str) -> list:
    """srun's argv up to the interpreter's `-u -m MODULE ...`, without the log options."""
    argv, out = srun_line(text)[1], []
    while argv[:2] != ["-u", "-m"]:
        arg = argv.pop(0)
        if arg in LOG_OPTIONS:
            argv.pop(0)  # submitit's `--output PATH`
        elif arg != "--unbuffered" and not arg.startswith(tuple(o + "=" for o in LOG_OPTIONS)):
            out.append(arg)
    return out


@pytest.mark.parametrize("runtime", list(CONTAINERS))
def test_standalone_script_is_the_submitit_job(tmp_path, on_login_node, capsys, runtime):
    overrides = [*AWKWARD, f"slurm.container.runtime={runtime}", *CONTAINERS[runtime]]
    if runtime != "none":
        overrides.append(f"slurm.container.image={IMAGES[runtime]}")
    folder = tmp_path / "my runs"
    standalone, by_submitit = standalone_script(folder, overrides, capsys), submitit_script(overrides)
    assert sbatch_options(standalone) == sbatch_options(by_submitit)
    assert "--job-name=my run; $(id) 'q' \"dq\" #3" in sbatch_options(standalone)
    assert "--reservation=my res" in sbatch_options(standalone)
    assert srun_argv(standalone) == srun_argv(by_submitit)
    # the same restart supervisor, with the same settings, runs both scripts' srun (docs/resilience.md)
    assert srun_line(standalone)[0] == srun_line(by_submitit)[0] and "--max-restarts" in srun_line(standalone)[0]
    logs = [shlex.split(line[len("#SBATCH"):])[0] for line in standalone.splitlines()
            if line.startswith(("#SBATCH --output", "#SBATCH --error"))]
    assert logs == [f"--output={folder}/logs/%j_batch.out", f"--error={folder}/logs/%j_batch.err"]
    assert f"--output={folder}/logs/%j_%t.out" in srun_line(standalone)[1]


# ------------------------------------------------------------------ values sbatch cannot take as meant
@pytest.mark.parametrize("override,message", [
    ("slurm.additional={nodes: 5}", "slurm.additional.nodes: set slurm.nodes instead"),
    ("slurm.additional={N: 5}", "slurm.additional.N: set slurm.nodes instead"),
    ("slurm.additional={ntasks_per_node: 4}", "slurm.additional.ntasks_per_node: set slurm.tasks_per_node instead"),
    ("slurm.additional={ntasks-per-n: 4}", "slurm.additional.ntasks-per-n: set slurm.tasks_per_node instead"),
    ("slurm.additional={t: 30}", "slurm.additional.t: set slurm.time_min instead"),
    ("slurm.additional={gpus: 8}", "slurm.additional.gpus: set slurm.gpus_per_node instead"),
    ("slurm.additional={output: /x}", "slurm.additional.output: set slurm.log_dir instead"),
    ("slurm.additional={array: 0-3}", "slurm.additional.array: --array is not supported"),
    ("slurm.job_name='a\\b'", "slurm.job_name: contains a backslash"),
    ("slurm.additional={comment: 'x\\y'}", "slurm.additional.comment: contains a backslash"),
])
def test_sbatch_values_the_plan_owns_or_sbatch_misreads_are_refused(on_login_node, capsys, override, message):
    rc = submit.main(["configs/smoke.yaml", "--dry-run", override])
    out, err = capsys.readouterr()
    assert rc == 2 and "dry run" not in out, out
    assert err.startswith(f"error: {message}") and err.count("\n") == 1 and "Traceback" not in err, err


def test_script_folder_sbatch_cannot_carry_is_refused(tmp_path, on_login_node, capsys):
    script = tmp_path / "a\\b" / "job.sbatch"
    rc = submit.main(["configs/smoke.yaml", "--sbatch-script", str(script)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --sbatch-script: ") and err.count("\n") == 1, err
    assert "'\\\\'" in err and not script.parent.exists()
