"""The ready sbatch scripts (launch/*.sbatch), the dev-cluster scripts and the container recipes.

Static checks read the `#SBATCH` header the way sbatch does; the run checks execute each launch
script with a stand-in `srun` on PATH, so the exact command every rank would run and its
environment are checked without a Slurm cluster.
"""
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
EXPECTED = {"ppo_70b.sbatch": {"nodes": 8}, "grpo_8b.sbatch": {"nodes": 1}, "grpo_70b_lora.sbatch": {"nodes": 1},
            "grpo_deepseek_v3.sbatch": {"nodes": 32}}
SCRIPTS = sorted(LAUNCH.glob("*.sbatch"))
SHELL_SCRIPTS = [
    ROOT / "slurm/devcluster/start.sh",
    ROOT / "slurm/devcluster/stop.sh",
    ROOT / "slurm/devcluster/netns.sh",
    ROOT / "slurm/devcluster/on_node.sh",
    ROOT / "containers/install.sh",
    ROOT / "containers/enroot/build.sh",
    ROOT / "containers/build.sh",
]


def sbatch_options(path: Path) -> dict[str, str]:
    """`#SBATCH` options as sbatch reads them: only before the first command line."""
    opts: dict[str, str] = {}
    for line in path.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            for token in shlex.split(stripped[len("#SBATCH"):]):
                key, _, value = token.partition("=")
                opts[key] = value
    return opts


def job_command(path: Path) -> tuple[str, str]:
    """The srun line's options and the config path given to `python -m verl_hpc.job`."""
    text = path.read_text()
    match = re.search(r"python -m verl_hpc\.job\s+(\S+)", text)
    assert match, f"{path.name}: no `python -m verl_hpc.job CONFIG` command"
    return text, match.group(1)


def test_expected_scripts_exist():
    assert {p.name for p in SCRIPTS} >= set(EXPECTED), sorted(p.name for p in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS + SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_syntax(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_header(path):
    opts = sbatch_options(path)
    for key in ["--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task", "--exclusive",
                "--time", "--signal", "--requeue", "--output"]:
        assert key in opts, f"{path.name}: missing #SBATCH {key}"
    assert opts["--ntasks-per-node"] == opts["--gpus-per-node"], "one rank per GPU"
    assert int(opts["--gpus-per-node"]) == 8
    if path.name in EXPECTED:
        assert int(opts["--nodes"]) == EXPECTED[path.name]["nodes"]
    # Warning signal with a lead time, sent to the steps (no "B:" prefix: ranks, not the shell).
    signal = re.fullmatch(r"(?:R:)?(?:SIG)?(USR1|USR2|TERM)@(\d+)", opts["--signal"])
    assert signal and int(signal.group(2)) >= 60, opts["--signal"]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_srun_line_and_config_exists(path):
    text, config = job_command(path)
    assert "--mpi=pmix" in text and "--kill-on-bad-exit=1" in text
    assert (ROOT / config).is_file(), f"{path.name} runs {config}, which does not exist in configs/"
    assert config.startswith("configs/")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_env_defaults_are_overridable(path):
    text = path.read_text()
    for name, value in [("NCCL_DEBUG", "WARN"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
                        ("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("HDF5_USE_FILE_LOCKING", "FALSE")]:
        assert f': "${{{name}:={value}}}"' in text, f"{path.name}: {name} default missing"
    assert "NCCL_SOCKET_IFNAME" in text  # documented, left unset


# --------------------------------------------------------------------------- run with a stub srun
STUB_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_DIR/args"
env -0 > "$STUB_DIR/env"
"""


def run_script(path: Path, tmp_path: Path, extra_env: dict[str, str], args: list[str]):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "srun").write_text(STUB_SRUN)
    (bindir / "srun").chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STUB_DIR": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node001",
        "SLURM_NTASKS": "8",
        "SLURM_CPUS_PER_TASK": "12",
        "RUN_DIR": str(tmp_path / "run-%j"),  # the supervisor's folder: not the checkout's logs/
        **extra_env,
    }
    result = subprocess.run(["bash", str(path), *args], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    srun_args = env_out = None
    if (tmp_path / "args").exists():
        srun_args = (tmp_path / "args").read_text().split("\0")[:-1]
        env_out = dict(kv.split("=", 1) for kv in (tmp_path / "env").read_text().split("\0") if "=" in kv)
    return result, srun_args, env_out


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_runs_entry_point_without_container(path, tmp_path):
    _, config = job_command(path)
    overrides = ["trainer.total_steps=3", "note=a b"]
    result, args, env = run_script(path, tmp_path, {"NCCL_DEBUG": "INFO"}, overrides)
    assert result.returncode == 0, result.stderr
    assert args[:2] == ["--mpi=pmix", "--kill-on-bad-exit=1"]
    assert args[2:] == ["python", "-m", "verl_hpc.job", config, *overrides]
    assert env["NCCL_DEBUG"] == "INFO"  # the submitting environment wins over the default
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["HDF5_USE_FILE_LOCKING"] == "FALSE"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["OMP_NUM_THREADS"] == "12" and env["SRUN_CPUS_PER_TASK"] == "12"
    assert "verl_hpc.job" in result.stdout  # the command line is printed into the log


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_runs_in_apptainer(path, tmp_path):
    _, config = job_command(path)
    image = tmp_path / "img.sif"
    image.write_text("")
    result, args, _ = run_script(path, tmp_path, {"CONTAINER": "apptainer", "IMAGE": str(image),
                                                  "BINDS": "/data,/ckpt:/c"}, ["x=1"])
    assert result.returncode == 0, result.stderr
    assert args == ["--mpi=pmix", "--kill-on-bad-exit=1", "apptainer", "exec", "--nv",
                    "--bind", f"{ROOT},/data,/ckpt:/c", "--pwd", str(ROOT), str(image),
                    "python", "-m", "verl_hpc.job", config, "x=1"]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_runs_in_pyxis(path, tmp_path):
    _, config = job_command(path)
    result, args, _ = run_script(path, tmp_path, {"CONTAINER": "pyxis", "IMAGE": "nvcr.io#org/img:1",
                                                  "BINDS": "/data,/ckpt:/c"}, [])
    assert result.returncode == 0, result.stderr
    assert args == ["--mpi=pmix", "--kill-on-bad-exit=1", "--container-image=nvcr.io#org/img:1",
                    f"--container-mounts={ROOT}:{ROOT},/data:/data,/ckpt:/c",
                    f"--container-workdir={ROOT}", "python", "-m", "verl_hpc.job", config]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_runs_in_charliecloud(path, tmp_path):
    _, config = job_command(path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    result, args, env = run_script(path, tmp_path, {"CONTAINER": "charliecloud", "IMAGE": "verl_hpc:cpu",
                                                    "BINDS": "/data,/ckpt:/c", "USER": "u",
                                                    "CH_IMAGE_STORAGE": str(tmp_path / "st")}, ["x=1"])
    assert result.returncode == 0, result.stderr
    # mount points made in the image directory first, then every rank in ch-run
    for p in [str(ROOT), "/data", "/c"]:
        assert (tmp_path / "st" / "img" / "verl_hpc+cpu" / p.lstrip("/")).is_dir(), p
    assert args == ["--mpi=pmix", "--kill-on-bad-exit=1", "ch-run", f"--bind={ROOT}", "--bind=/data",
                    "--bind=/ckpt:/c", f"--cd={ROOT}", "verl_hpc:cpu", "--",
                    "python", "-m", "verl_hpc.job", config, "x=1"]
    assert env["PMIX_MCA_gds"] == "hash" and env["USER"] == "u"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bad_container_or_missing_image_fail_clearly(path, tmp_path):
    result, args, _ = run_script(path, tmp_path, {"CONTAINER": "docker"}, [])
    assert result.returncode == 2 and args is None and "CONTAINER=docker" in result.stderr
    missing = str(tmp_path / "nope.sif")
    result, args, _ = run_script(path, tmp_path, {"CONTAINER": "apptainer", "IMAGE": missing}, [])
    assert result.returncode == 2 and args is None and missing in result.stderr


# --------------------------------------------------------------------------- containers
def test_apptainer_definition_sections():
    text = (ROOT / "containers/verl_hpc.def").read_text()
    sections = set(re.findall(r"^%(\w+)", text, flags=re.MULTILINE))
    assert "post" in sections
    assert sections & {"runscript", "environment"}
    assert re.search(r"^Bootstrap:\s*docker", text, flags=re.MULTILINE)
    assert re.search(r"^From:\s*nvcr\.io/nvidia/pytorch:", text, flags=re.MULTILINE)
    # every %files source exists, relative to the repository root (where the build runs)
    files = re.search(r"^%files\n(.*?)(?=^%)", text, flags=re.MULTILINE | re.DOTALL).group(1)
    for line in files.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            assert (ROOT / line.split()[0]).exists(), line


def test_dockerfiles_copy_existing_paths():
    text = (ROOT / "containers/Dockerfile").read_text()
    # GPU by default (NGC base, `gpu` extra); the CPU image only swaps these two build arguments
    assert re.search(r"^ARG BASE=nvcr\.io/nvidia/pytorch:", text, flags=re.MULTILINE)
    assert re.search(r"^FROM \$BASE$", text, flags=re.MULTILINE)
    assert re.search(r"^ARG EXTRA=gpu$", text, flags=re.MULTILINE)
    for src in re.findall(r"^COPY\s+(\S+)\s", text, flags=re.MULTILINE):
        assert (ROOT / src).exists(), src
    assert "MELLANOX_VISIBLE_DEVICES" in (ROOT / "containers/enroot/Dockerfile").read_text()
    install = (ROOT / "containers/install.sh").read_text()
    assert "[gpu]" in install


def test_devcluster_scripts_are_executable_and_knobs_documented():
    readme = (ROOT / "slurm/devcluster/README.md").read_text()
    start = (ROOT / "slurm/devcluster/start.sh").read_text()
    for knob in re.findall(r"\$\(knob ([A-Z_]+) ", start):
        assert f"VERL_HPC_DEVCLUSTER_{knob}" in readme, knob
    for name in ["start.sh", "stop.sh"]:
        assert os.access(ROOT / "slurm/devcluster" / name, os.X_OK), name


# --------------------------------------------------------------------------- in-allocation restarts
@pytest.mark.parametrize("path", SCRIPTS + [LAUNCH / "dev" / "grpo_2x2_cpu.sbatch"], ids=lambda p: p.name)
def test_srun_runs_under_the_restart_supervisor_with_the_config_defaults(path, tmp_path):
    """Each script runs srun through launcher/restart_loop.py (docs/resilience.md) with --no-kill in
    its header; its knobs' defaults are the config's, and a batch host without the supervisor's
    python3 fails in one line before any srun."""
    from verl_hpc.config.sections.cluster import SlurmConfig

    text, opts = path.read_text(), sbatch_options(path)
    assert "--no-kill" in opts, path.name
    d = SlurmConfig()
    for knob, value in [("MAX_RESTARTS", d.max_restarts), ("RESTART_BACKOFF_S", f"{d.restart_backoff_s:g}"),
                        ("SPARE_NODES", d.spare_nodes)]:
        assert f': "${{{knob}:={value}}}"' in text, f"{path.name}: {knob} default is not slurm's {value}"
    assert 'CMD=("${SUPERVISOR[@]}" srun --mpi=pmix' in text
    result, args, env = run_script(path, tmp_path, {"MAX_RESTARTS": "1", "SPARE_NODES": "0"}, ["x=1"])
    assert result.returncode == 0, result.stderr
    assert args[:2] == ["--mpi=pmix", "--kill-on-bad-exit=1"] and env["VERL_HPC_ATTEMPT"] == "0"
    assert env["VERL_HPC_HEARTBEAT_DIR"] == str(tmp_path / "run-4242/heartbeats/launch0"), env["VERL_HPC_HEARTBEAT_DIR"]
    (tmp_path / "bare").mkdir()
    result, args, _ = run_script(path, tmp_path / "bare", {"SUPERVISOR_PYTHON": "no-such-python3"}, [])
    assert result.returncode == 2 and args is None
    assert result.stderr.strip().splitlines()[-1].startswith("SUPERVISOR_PYTHON=no-such-python3 not found on ")
