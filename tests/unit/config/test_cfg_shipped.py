"""The YAML files in configs/ load, validate (without their placeholder model folders), say what
their comments claim, and are written as a base plus their differences.

configs/base*.yaml are bases, not jobs: base.yaml (generated, every field), base_gpu_cluster.yaml
(what the GPU-cluster recipes share) and base_70b.yaml (what the 70B recipes share on top of it).
Every other file is a recipe that extends one of them (or another recipe) and lists only what
differs: a value its parents, its algorithm.recipe or the schema already give is refused."""
import dataclasses
from pathlib import Path

import pytest

from verl_hpc.config import load_config, validate
from verl_hpc.config.loader import deep_merge, file_layers
from verl_hpc.config.recipes import RECIPES
from verl_hpc.config.schema import JobConfig
from verl_hpc.config.structure import dotted


CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASES = sorted(p.name for p in CONFIGS.glob("base*.yaml"))
JOBS = sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name not in BASES)


def test_the_bases_and_the_recipes_are_found():
    assert BASES == ["base.yaml", "base_70b.yaml", "base_gpu_cluster.yaml"]
    assert {"smoke.yaml", "demo_rl.yaml", "grpo_8b.yaml", "ppo_70b.yaml", "grpo_70b_lora.yaml",
            "grpo_30b_a3b.yaml"} <= set(JOBS)


@pytest.mark.parametrize("name", JOBS)
def test_shipped_config_is_valid(name):
    validate(load_config(CONFIGS / name), check_model=False)


def test_every_handwritten_base_is_extended():
    """A base no recipe extends would be a recipe nobody runs, or dead text."""
    parents = {Path(layer.where(())).name for name in JOBS for layer in file_layers(CONFIGS / name)[:-1]}
    assert set(BASES) <= parents, set(BASES) - parents


# ------------------------------------------------------------------ key resolved values
GPU_CLUSTER = {"model.dtype": "bfloat16", "parallel.backend": "nccl", "parallel.sequence_parallel": True,
               "parallel.recompute_granularity": "full", "rollout.enforce_eager": "false",
               "rollout.sleep_between_phases": "true", "checkpoint.async_save": True,
               "slurm.tasks_per_node": 8, "slurm.gpus_per_node": 8, "slurm.gpu_type": "h100-80gb",
               "slurm.cpus_per_task": 12, "slurm.exclusive": True,
               "tracking.backends": ["console", "jsonl", "tensorboard"]}
OFFLOAD = {"actor.param_offload": True, "actor.grad_offload": True, "actor.optimizer_offload": True,
           "ref.param_offload": True}
LLAMA_70B = {"model.path": "/path/to/Meta-Llama-3-70B-Instruct", "parallel.tp": 8, "rollout.tp": 8,
             "actor.max_tokens_per_microbatch": 8192, "trainer.collective_timeout_s": 1800}
CPU = {"model.dtype": "float32", "slurm.gpus_per_node": 0, "checkpoint.async_save": False,
       "tracking.backends": ["console", "jsonl"]}
DEMO = {**CPU, "world_size": 1, "rollout.engine": "auto", "rollout.temperature": 1.0, "rollout.n": 8,
        "data.max_prompt_length": 32, "data.val_batch_size": 100, "data.train_batch_size": 32,
        "actor.micro_batch_size": 64, "trainer.job": "rl"}

KEY_VALUES = {
    "grpo_8b.yaml": {**GPU_CLUSTER, **OFFLOAD, "slurm.nodes": 1, "world_size": 8, "parallel.tp": 2,
                     "parallel.pp": 1, "dp": 4, "rollout.tp": 2, "rollout.n": 8, "actor.optim.lr": 1e-6,
                     "actor.max_tokens_per_microbatch": 16384, "slurm.time_min": 1440,
                     "slurm.signal_delay_s": 300, "trainer.collective_timeout_s": 600},
    "grpo_30b_a3b.yaml": {**GPU_CLUSTER, **OFFLOAD, "slurm.nodes": 2, "world_size": 16, "parallel.tp": 2,
                          "parallel.ep": 8, "rollout.tp": 2, "model.moe_aux_loss_coef": 0.001,
                          "model.moe_z_loss_coef": 0.0, "actor.optim.lr": 1e-6},
    "grpo_deepseek_v3.yaml": {**GPU_CLUSTER, **OFFLOAD, "slurm.nodes": 32, "world_size": 256, "parallel.tp": 8,
                              "parallel.pp": 1, "parallel.ep": 256, "parallel.etp": 1, "dp": 32, "rollout.tp": 32,
                              "model.moe_router_bias_update_rate": 0.001, "slurm.signal_delay_s": 600},
    "ppo_70b.yaml": {**GPU_CLUSTER, **OFFLOAD, **LLAMA_70B, "slurm.nodes": 8, "world_size": 64,
                     "parallel.pp": 2, "parallel.vpp": 5, "dp": 4, "critic.enable": True, "rollout.n": 1,
                     "critic.param_offload": True, "slurm.time_min": 2880, "slurm.signal_delay_s": 600,
                     "parallel.use_distributed_optimizer": True, "slurm.container.runtime": "none"},
    # the long-response variants: the sequence split over 2 ranks (context parallelism, out of dp)
    "ppo_70b_64k.yaml": {**GPU_CLUSTER, **OFFLOAD, "model.path": "/path/to/Llama-3.1-70B-Instruct",
                         "parallel.tp": 8, "parallel.pp": 2, "parallel.cp": 2, "dp": 1, "slurm.nodes": 4,
                         "world_size": 32, "data.max_response_length": 65536, "rollout.max_tokens": 65536,
                         "actor.max_tokens_per_microbatch": 66560, "critic.max_tokens_per_microbatch": 66560,
                         "critic.enable": True},
    "grpo_30b_a3b_40k.yaml": {**GPU_CLUSTER, **OFFLOAD, "slurm.nodes": 2, "world_size": 16, "parallel.tp": 2,
                              "parallel.cp": 2, "dp": 4, "parallel.ep": 8, "data.max_response_length": 39936,
                              "actor.max_tokens_per_microbatch": 40960},
    "grpo_70b_lora.yaml": {**GPU_CLUSTER, **LLAMA_70B, "slurm.nodes": 1, "world_size": 8, "parallel.pp": 1,
                           "lora.rank": 32, "lora.alpha": 64.0, "lora.sync": "auto", "actor.use_kl_loss": True,
                           "actor.kl_loss_coef": 0.001, "actor.param_offload": False,
                           "ref.param_offload": False, "slurm.mem_gb": 1800},
    "grpo_tiny_cpu.yaml": {**CPU, "world_size": 2, "parallel.tp": 2, "parallel.backend": "gloo",
                           "rollout.tp": 1, "rollout.n": 4, "data.train_batch_size": 8,
                           "actor.micro_batch_size": 4, "slurm.cpus_per_task": 1},
    "smoke.yaml": {**CPU, "trainer.job": "smoke", "world_size": 2, "parallel.backend": "gloo",
                   "trainer.smoke.steps": 3, "slurm.cpus_per_task": 1},
    "demo_rl.yaml": {**DEMO, "actor.use_kl_loss": False, "actor.optim.lr_decay_style": "cosine"},
    # the demo's RL phase with vLLM quantizing the policy at each sync; TIS resolved on by auto
    "demo_rl_fp8.yaml": {**DEMO, "rollout.engine": "vllm", "rollout.quantization": "fp8_per_channel",
                         "algorithm.rollout_correction.rollout_is": "token"},
    "demo_agent.yaml": {**CPU, "world_size": 1, "rollout.engine": "hf", "data.train_batch_size": 16,
                        "agent.enable": True, "agent.function": "verl_hpc.trainer.programs.demo_agent_solver:solve",
                        "safety.allow_custom_code": True, "trainer.total_steps": 40},
    "demo_sft.yaml": {**CPU, "trainer.job": "sft", "data.train_batch_size": 64, "actor.micro_batch_size": 64,
                      "trainer.sft_epochs": 40, "slurm.cpus_per_task": 1},
    # DPO keeps temperature 1 (the engines' log-probs are of logits / temperature) and the DPO loss
    "demo_dpo.yaml": {**DEMO, "trainer.job": "dpo", "algorithm.preference.loss": "dpo",
                      "algorithm.preference.beta": 0.1, "actor.ppo_mini_batch_size": 32,
                      "actor.optim.warmup_steps": 0, "actor.optim.lr_decay_style": "constant"},
    "demo_lora.yaml": {**DEMO, "lora.rank": 16, "lora.alpha": 32.0},
    "demo_fsdp.yaml": {**DEMO, "parallel.engine": "fsdp", "actor.use_kl_loss": False},
    "demo_moe.yaml": {**CPU, "rollout.engine": "hf", "parallel.ep": 2, "world_size": 2,
                      "model.moe_routing_replay": "rollout"},
    "demo_moe_noreplay.yaml": {**CPU, "rollout.engine": "hf", "parallel.ep": 2, "model.moe_routing_replay": "off"},
    "demo_rl_split.yaml": {**CPU, "placement.mode": "split", "async_training.objective": "decoupled"},
    "demo_prime.yaml": {**DEMO, "algorithm.adv_estimator": "prime", "prm.enable": True},
    "demo_judge.yaml": {**DEMO, "reward.reward_model.kind": "judge", "reward.reward_model.rule_weight": 0.0,
                        "reward.reward_model.validate": False, "reward.reward_model.judge.verdict": "pattern"},
    "demo_judge_sft.yaml": {**CPU, "trainer.job": "sft", "data.wrap_plain_text": False, "slurm.cpus_per_task": 1,
                            "actor.optim.lr": 2e-3},
    "demo_prime_rloo.yaml": {**DEMO, "algorithm.adv_estimator": "rloo", "prm.enable": False},
    "demo_distill.yaml": {**DEMO, "teacher.enable": True, "teacher.mode": "reward", "teacher.coef": 1.0,
                          "trainer.total_steps": 40},
    "demo_distill_grpo.yaml": {**DEMO, "teacher.enable": False, "trainer.total_steps": 40},
    "demo_tool.yaml": {**DEMO, "multi_turn.enable": True, "data.max_response_length": 160,
                       "data.train_batch_size": 16},
    "demo_tool_sft.yaml": {**CPU, "trainer.job": "sft", "data.max_prompt_length": 32,
                           "trainer.sft_epochs": 40, "slurm.cpus_per_task": 2},
    "demo_vlm.yaml": {**CPU, "parallel.engine": "fsdp", "vision.train_vision_tower": False,
                      "data.max_response_length": 8, "world_size": 1},
    "demo_vlm_sft.yaml": {**CPU, "trainer.job": "sft", "parallel.engine": "fsdp", "slurm.cpus_per_task": 1,
                          "vision.train_vision_tower": True},
    # make demo-vlm-vllm's two RL phases: demo_vlm.yaml's job with each rollout engine named
    "demo_vlm_vllm.yaml": {**CPU, "parallel.engine": "fsdp", "rollout.engine": "vllm", "rollout.n": 16,
                           "vision.train_vision_tower": False},
    "demo_vlm_hf.yaml": {**CPU, "parallel.engine": "fsdp", "rollout.engine": "hf", "rollout.n": 16,
                         "vision.train_vision_tower": False},
}


def test_every_recipe_has_key_values():
    assert sorted(KEY_VALUES) == JOBS


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("name", sorted(KEY_VALUES))
def test_recipe_resolves_to_its_key_values(name):
    cfg = load_config(CONFIGS / name)
    got = {key: _get(cfg, key) for key in KEY_VALUES[name]}
    assert got == KEY_VALUES[name]


# ------------------------------------------------------------------ differences only
def _leaves(data: dict, path: tuple = ()):
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + (key,))
        else:
            yield path + (key,), value


def _find(data, path: tuple):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return False, None
        data = data[key]
    return True, data


def _same(a, b) -> bool:
    """Equal as the typed config would hold them: 1 == 1.0, but True is no 1."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def repeated_values(path: Path):
    """'file: field = value is already set to that by <where>' for every leaf of `path` whose value
    the layers below it give already: its extends chain, then the recipe it names, then the schema."""
    layers = file_layers(path)
    own, parents = layers[-1], layers[:-1]
    merged: dict = {}
    for layer in layers:
        deep_merge(merged, layer.data)
    below = [("the schema default", dataclasses.asdict(JobConfig()))]
    recipe = (merged.get("algorithm") or {}).get("recipe")
    if recipe:
        below.append((f"algorithm.recipe {recipe!r} (verl_hpc/config/recipes.py)", RECIPES[recipe]))
    below += [(Path(layer.where(())).name, layer.data) for layer in parents]
    found = []
    for key, value in _leaves(own.data):
        for where, data in reversed(below):  # the nearest layer that sets the field decides
            present, inherited = _find(data, key)
            if present:
                if _same(inherited, value):
                    found.append(f"{path.name}: {dotted(key)} = {value!r} is already set to that by {where}")
                break
    return found


@pytest.mark.parametrize("name", [n for n in JOBS + BASES if n != "base.yaml"])
def test_config_lists_only_its_differences(name):
    """base.yaml is exempt: it is the generated list of every default."""
    problems = repeated_values(CONFIGS / name)
    assert not problems, ("a config lists only what differs from what it extends; remove "
                          "(or turn into a comment) " + "; ".join(problems))


def test_the_differences_rule_names_the_file_the_field_and_the_parent(tmp_path):
    (tmp_path / "base.yaml").write_text((CONFIGS / "base.yaml").read_text())
    (tmp_path / "parent.yaml").write_text("extends: base.yaml\nalgorithm: {recipe: grpo}\n"
                                          "rollout: {n: 8, tp: 2}\n")
    (tmp_path / "child.yaml").write_text("extends: parent.yaml\nrollout: {n: 8, tp: 4, temperature: 1.0}\n"
                                         "actor: {use_kl_loss: true, optim: {lr: 2.0e-6}}\n")
    assert repeated_values(tmp_path / "child.yaml") == [
        "child.yaml: rollout.n = 8 is already set to that by parent.yaml",
        "child.yaml: rollout.temperature = 1.0 is already set to that by base.yaml",
        "child.yaml: actor.use_kl_loss = True is already set to that by algorithm.recipe 'grpo' "
        "(verl_hpc/config/recipes.py)",
    ]
    (tmp_path / "lone.yaml").write_text("rollout: {n: 1}\ntrainer: {total_steps: 10}\n")
    assert repeated_values(tmp_path / "lone.yaml") == [
        "lone.yaml: rollout.n = 1 is already set to that by the schema default",
        "lone.yaml: trainer.total_steps = 10 is already set to that by the schema default",
    ]


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
