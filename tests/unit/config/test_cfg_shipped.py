"""The YAML files in configs/ load, validate (without their placeholder model folders) and say
what their comments claim."""
from pathlib import Path

import pytest

from verl_hpc.config import load_config, validate


CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("name", ["smoke", "demo_sft", "demo_rl", "grpo_tiny_cpu", "grpo_8b",
                                  "ppo_70b"])
def test_shipped_config_is_valid(name):
    validate(load_config(CONFIGS / f"{name}.yaml"), check_model=False)


def test_smoke_is_two_local_cpu_ranks():
    cfg = load_config(CONFIGS / "smoke.yaml")
    validate(cfg, check_model=True)  # no model involved
    assert (cfg.trainer.job, cfg.world_size, cfg.slurm.gpus_per_node, cfg.parallel.backend) == \
        ("smoke", 2, 0, "gloo")


def test_grpo_8b_layout():
    cfg = load_config(CONFIGS / "grpo_8b.yaml")
    assert (cfg.slurm.nodes, cfg.slurm.gpus_per_node, cfg.parallel.tp, cfg.dp) == (1, 8, 2, 4)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor.use_kl_loss and cfg.ref.enable


def test_ppo_70b_layout_and_model_shape(model_dir):
    cfg = load_config(CONFIGS / "ppo_70b.yaml")
    assert (cfg.world_size, cfg.parallel.tp, cfg.parallel.pp, cfg.dp, cfg.rollout.tp) == (64, 8, 2, 4, 8)
    assert cfg.critic.enable and cfg.ref.enable and cfg.algorithm.adv_estimator == "gae"
    # With a Llama-3-70B-shaped config.json the model checks pass too.
    path = model_dir(heads=64, kv=8, layers=80)
    validate(load_config(CONFIGS / "ppo_70b.yaml", [f"model.path={path}"]), check_model=True)
