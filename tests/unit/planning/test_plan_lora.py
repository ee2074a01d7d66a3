"""The memory plan with LoRA: the adapter's size per rank by hand and as the engine builds it, a
frozen base with no gradient or optimizer state, a reference that costs nothing, and the shipped
70B LoRA config on one node (which full-parameter training of the same job does not fit)."""
import pytest

from verl_hpc.config import load_config
from verl_hpc.models.config_mapping import load_arch
from verl_hpc.planning import MARGIN, plan_job
from verl_hpc.planning.model_shape import known_arch, lora_layer_params, stage_params
from verl_hpc.planning.training import Precision, model_state_bytes

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_adapter_elements_per_layer_by_hand():
    arch = known_arch("llama-3-70b")  # h 8192, 64 heads x 128, 8 KV heads, ffn 28672
    r, h, f = 16, 8192, 28672
    qkv_out = (64 + 2 * 8) * 128
    for tp in (1, 8):
        want = ((r * h + r * qkv_out // tp) + (r * h // tp + r * h)       # qkv (column), proj (row)
                + (r * h + r * 2 * f // tp) + (r * f // tp + r * h))      # fc1 (column), fc2 (row)
        assert lora_layer_params(arch, r, TARGETS, tp) == want
    assert lora_layer_params(arch, r, ("linear_qkv",), 1) == r * (h + qkv_out)


def test_the_planned_adapter_is_what_the_engine_builds(one_rank_world, tmp_path):
    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.lora import adapter_parameters
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "m", "llama", layers=2)
    init_model_parallel(1, 1)
    eng = MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(rank=8, target_modules=list(TARGETS))))
    built = sum(p.numel() for p in adapter_parameters(eng.gpt_chunks))
    assert built == 2 * lora_layer_params(load_arch(model), 8, TARGETS, 1)


def test_a_frozen_base_has_no_gradient_or_optimizer_bytes():
    arch = known_arch("llama-3-8b")
    params = stage_params(arch, 2, 1, 0)
    prec = Precision.of("bfloat16")
    adapter = params.layers * lora_layer_params(arch, 16, TARGETS, 2)
    full = model_state_bytes(params, prec, trainable=True, dp=4, distributed_optimizer=True)
    lora = model_state_bytes(params, prec, trainable=True, dp=4, distributed_optimizer=True, adapter=adapter)
    assert lora == {"weights": params.total * 2 + adapter * 4, "grads": adapter * 4, "optimizer": adapter * 8 / 4}
    assert lora["grads"] + lora["optimizer"] < 0.01 * (full["grads"] + full["optimizer"])


def test_the_reference_costs_nothing_with_lora():
    over = ["actor.use_kl_loss=true", "ref.param_offload=false"]
    full = plan_job(load_config("configs/grpo_8b.yaml", over))
    lora = plan_job(load_config("configs/grpo_8b.yaml", [*over, "lora.rank=16"]))
    assert full.table["ref_logprob"]["ref"] > 1e9
    assert lora.table["ref_logprob"]["ref"] == 0.0 and lora.table["ref_logprob"]["actor"] > 1e9
    assert any("the reference is the actor's base (no memory)" in n for n in lora.notes)


def test_the_70b_lora_config_fits_one_node_and_full_training_does_not():
    cfg = load_config("configs/grpo_70b_lora.yaml", [])
    assert cfg.slurm.nodes == 1 and cfg.slurm.gpus_per_node == 8 and cfg.lora.rank > 0
    plan = plan_job(cfg)
    assert plan.fits(margin=max(MARGIN, 0.10)), plan.headroom()
    full = plan_job(load_config("configs/grpo_70b_lora.yaml", ["lora.rank=0"]))
    assert not full.fits()
    # the adapter sync's bytes, not the model's, and vLLM's LoRA slot counted
    assert plan.table["weight_sync"]["resharding"] < full.table["weight_sync"]["resharding"]


@pytest.mark.parametrize("override, words", [("lora.sync=merged", "sleep level 2"), ("lora.sync=auto", "sleep level 1")])
def test_vllm_sleeps_at_level_1_with_a_lora_slot(override, words):
    plan = plan_job(load_config("configs/grpo_70b_lora.yaml", [override]))
    assert any(words in n for n in plan.notes), plan.notes
