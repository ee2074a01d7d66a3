"""The lora section: its checks name the field and what is valid, and the sync mode auto picks."""
import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.validate import validate

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "rollout.n=2", "lora.rank=8"]


def problems(*overrides):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*BASE, *overrides]), check_model=False)
    return e.value.problems


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
    cfg = load_config(None, [])
    assert not cfg.lora.enabled
    lora = load_config(None, ["lora.rank=4", "lora.alpha=16"]).lora
    assert lora.scale == 4.0
    assert lora.sync_mode("vllm") == "adapter" and lora.sync_mode("hf") == "merged"
    assert lora.sync_mode("vllm", split=True) == "merged"
    assert load_config(None, ["lora.rank=4", "lora.sync=merged"]).lora.sync_mode("vllm") == "merged"
