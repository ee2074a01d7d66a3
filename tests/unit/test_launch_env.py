"""Rank detection for each launcher, from the variables each one really sets."""
import os
import signal

import pytest

from verl_hpc.config.errors import ConfigError
from verl_hpc.runtime.launch_env import detect, expand_first_host, port_for_job
from verl_hpc.runtime.signals import PreemptionFlag


def test_torchrun_wins_over_slurm():
    env = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="n1",
               MASTER_PORT="1234", SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_NTASKS="1")
    e = detect(env)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == \
        ("torchrun", 3, 4, 1, "n1", 1234)


def test_mpirun_inside_allocation_uses_open_mpi_ranks():
    # inside an allocation every mpirun rank sees SLURM_PROCID=0 (docs/platform-notes.md, "Slurm and
    # MPI"): OMPI_* must win
    env = dict(OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_COMM_WORLD_NODE_RANK="1",
               SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_NTASKS="1", SLURM_JOB_ID="77")
    e = detect(env)
    assert (e.launcher, e.rank, e.world_size, e.node_rank, e.mpi_capable) == ("mpirun", 2, 4, 1, True)
    assert e.master_addr == "" and e.master_port == 0  # agreed over MPI at bootstrap


def test_srun_step():
    env = dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_NODEID="2",
               SLURM_STEP_ID="0", SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="gpu[007-010]",
               SLURM_STEP_TASKS_PER_NODE="2(x4)", PMIX_RANK="5")
    e = detect(env)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.node_rank, e.local_world_size) == \
        ("srun", 5, 8, 1, 2, 2)
    assert e.master_port == port_for_job("4242") and e.mpi_capable
    assert e.master_addr in ("gpu007",)  # scontrol or the fallback parser, same answer


@pytest.mark.parametrize("spec,node,n", [("2(x4)", 3, 2), ("3,2", 1, 2), ("3,2", 0, 3),
                                         ("2(x2),1", 2, 1), ("4", 0, 4)])
def test_local_world_size_is_this_nodes_count(spec, node, n):
    env = dict(SLURM_PROCID="0", SLURM_NTASKS="9", SLURM_NODEID=str(node), SLURM_STEP_ID="0",
               SLURM_JOB_ID="1", SLURM_STEP_NODELIST="n[1-4]", SLURM_STEP_TASKS_PER_NODE=spec)
    assert detect(env).local_world_size == n


def test_batch_script_without_step_is_a_single_process():
    # the sbatch script itself has SLURM_PROCID=0 but is not a rank of the job step
    e = detect(dict(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_JOB_ID="9"))
    assert (e.launcher, e.rank, e.world_size) == ("single", 0, 1)


def test_bad_variable_is_named():
    with pytest.raises(ConfigError, match="WORLD_SIZE='four'"):
        detect(dict(RANK="0", WORLD_SIZE="four"))


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("gpu[012-015,020]", "gpu012"),
                                            ("a[3,5],b1", "a3")])
def test_first_host(nodelist, first, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # the fallback parser, not scontrol
    assert expand_first_host(nodelist) == first


def test_port_for_job_is_stable_and_in_range():
    assert port_for_job("123") == port_for_job("123") != port_for_job("124")
    assert 20000 <= port_for_job("99999999") < 40000


def test_preemption_flag_records_first_signal():
    flag = PreemptionFlag().install([signal.SIGUSR2])
    try:
        assert not flag.is_set() and not flag.agreed()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.is_set() and flag.signal_name == "SIGUSR2" and flag.agreed()
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_every_rank_gets_reproducible_mkl_and_the_user_value_wins(monkeypatch):
    from verl_hpc.config import JobConfig
    from verl_hpc.launcher.environment import job_environment

    cfg = JobConfig()
    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert job_environment(cfg)["MKL_CBWR"] == "AUTO,STRICT"
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # where the job is started: reproducing another machine
    assert job_environment(cfg)["MKL_CBWR"] == "AVX2"
    cfg.slurm.env = {"MKL_CBWR": "COMPATIBLE,STRICT"}
    assert job_environment(cfg)["MKL_CBWR"] == "COMPATIBLE,STRICT"


@pytest.mark.parametrize("given,expected", [(None, "AUTO,STRICT"), ("COMPATIBLE", "COMPATIBLE")])
def test_the_rank_entry_sets_mkl_before_torch_loads(given, expected):
    # a rank started by srun from an sbatch script gets no environment from the launcher
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if given:
        env["MKL_CBWR"] = given
    code = "import os, sys, verl_hpc.job; print(os.environ['MKL_CBWR'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [expected, "False"]


@pytest.mark.parametrize("engine, tp, expected", [("fsdp", 1, None), ("auto", 1, None), ("auto", 2, "1"),
                                                  ("megatron", 1, "1")])
def test_one_hardware_queue_only_for_megatron_gpu_jobs(engine, tp, expected):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 serialises FSDP2's reduce-scatter with the compute it overlaps:
    set for the jobs whose roles train on Megatron (auto with model parallelism), not for FSDP
    ones; slurm.env still sets it for any job."""
    from verl_hpc.config import JobConfig
    from verl_hpc.launcher.environment import job_environment

    cfg = JobConfig()
    cfg.slurm.gpus_per_node = 8
    cfg.parallel.engine, cfg.parallel.tp = engine, tp
    assert job_environment(cfg).get("CUDA_DEVICE_MAX_CONNECTIONS") == expected
    cfg.slurm.env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert job_environment(cfg)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
