"""Mixture-of-experts models in the job config: the expert layout rules (config/layout.py) and what
an MoE model needs of the rest of the job, each refused by name before anything is queued."""
import json

import pytest

from verl_hpc.config import load_config, validate
from verl_hpc.config.errors import ConfigError
from verl_hpc.config.layout import Layout


@pytest.fixture
def moe_folder(tmp_path):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 500,
           "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 6,
           "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _problems(folder, *overrides):
    cfg = load_config(None, [f"model.path={folder}", "trainer.job=rl", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_model=True)
    return "\n".join(e.value.problems)


def test_expert_layout_rules():
    assert Layout(8, tp=2, ep=2).edp == 2 and Layout(8, tp=2, ep=2).problems() == []
    assert Layout(8, tp=1, pp=2, ep=4).edp == 1
    words = " ".join(Layout(4, tp=1, ep=3).problems())
    assert "parallel.ep * parallel.etp = 3 * 1 does not divide the 4 ranks of a pipeline stage" in words
    assert "parallel.ep: must be > 0" in " ".join(Layout(4, ep=0).problems())


def test_experts_must_divide_over_ep(moe_folder):
    text = _problems(moe_folder, "parallel.ep=4", "slurm.tasks_per_node=4")
    assert "parallel.ep = 4 does not divide the model's number of experts = 6" in text
    assert "valid: 1, 2, 3, 6" in text


def test_moe_with_tp_needs_sequence_parallel_and_lora_is_refused(moe_folder):
    text = _problems(moe_folder, "parallel.tp=2", "lora.rank=8")
    assert "Megatron's MoE layer trains with tensor parallelism only under parallel.sequence_parallel=true" in text
    assert "lora.enabled with a mixture-of-experts model" in text


def test_vllm_rollout_of_moe_on_cpu_is_accepted(moe_folder):
    """vLLM's CPU reload of experts is fixed (rollout/vllm/cpu_moe.py): no refusal; the job's other
    problem is still reported, so the check ran."""
    text = _problems(moe_folder, "rollout.engine=vllm", "slurm.gpus_per_node=0", "lora.rank=8")
    assert "lora.enabled with a mixture-of-experts model" in text and "rollout.engine" not in text


def test_ep_needs_a_moe_model(tmp_path):
    from verl_hpc.models.tiny import hf_config

    hf_config("llama").save_pretrained(tmp_path)
    assert "parallel.ep = 2 needs a mixture-of-experts model" in _problems(tmp_path, "parallel.ep=2")


def test_unsupported_moe_variants_are_refused_by_field(moe_folder):
    from verl_hpc.models.config_mapping import parse_hf_config

    base = json.loads((moe_folder / "config.json").read_text())
    for change, words in ((dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
                          (dict(mlp_only_layers=[0]), "mlp_only_layers=[0] is not supported"),
                          (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 is not implemented"),
                          (dict(num_experts_per_tok=8), "num_experts_per_tok=8 is more than num_experts=6"),
                          (dict(architectures=["DeepseekV2ForCausalLM"]), "is not mapped into Megatron; mapped:")):
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_hf_config({**base, **change})
    arch = parse_hf_config(base)
    assert arch.moe.num_experts == 6 and arch.moe.renormalize is False and arch.qk_norm


@pytest.mark.parametrize("family,change,words", [
    ("qwen3_moe", dict(router_jitter_noise="0.1"), "router_jitter_noise='0.1' is not implemented; valid: 0 or null "
                                                   "(no noise on the router logits)"),
    ("qwen3_moe", dict(router_aux_loss_coef="1e-3"), "router_aux_loss_coef='1e-3': expected a number >= 0 (or null)"),
    ("qwen3_moe", dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef=-0.1: expected a number >= 0 (or null)"),
    ("qwen3_moe", dict(norm_topk_prob="false"), "norm_topk_prob='false': expected true or false"),
    ("qwen3_moe", dict(num_local_experts=8), "num_local_experts=8 and num_experts=6 disagree; valid: one of them, or "
                                             "both equal (the number of routed experts the weights hold)"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0: expected a positive "
                                                           "integer (a Qwen2-MoE layer always has its shared expert)"),
    ("qwen2_moe", dict(qkv_bias="false"), "qkv_bias='false': expected true or false"),
])
def test_a_moe_field_of_the_wrong_type_is_one_line_naming_file_and_field(moe_folder, family, change, words):
    """Not a ValueError from float() on a rank: the parser the submitter's model check runs too."""
    from verl_hpc.models.config_mapping import load_arch

    cfg = json.loads((moe_folder / "config.json").read_text())
    if family == "qwen2_moe":
        cfg.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", shared_expert_intermediate_size=96)
    (moe_folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError) as e:
        load_arch(moe_folder)
    assert str(e.value) == f"{moe_folder / 'config.json'}: {words}"


def test_routing_replay_on_a_dense_model_is_refused_by_name(tmp_path):
    from verl_hpc.models.tiny import hf_config

    hf_config("llama").save_pretrained(tmp_path)
    text = _problems(tmp_path, "model.moe_routing_replay=old")
    assert "model.moe_routing_replay = old needs a mixture-of-experts model, but model.path is dense" in text


def test_routing_replay_rollout_needs_an_engine_that_records_routes(moe_folder):
    text = _problems(moe_folder, "model.moe_routing_replay=rollout", "rollout.engine=vllm")
    line = next(x for x in text.splitlines() if "rollout.engine = vllm" in x)
    assert "model.moe_routing_replay = rollout" in line and "set rollout.engine=hf" in line
    # the same job with HF generate, or replaying the old forward's routes, passes that check (the
    # job's other problems are still reported: the checks ran)
    for ok in ("rollout.engine=hf", "model.moe_routing_replay=old"):
        text = _problems(moe_folder, "model.moe_routing_replay=rollout", "rollout.engine=vllm", ok)
        assert "data.train_files" in text and "moe_routing_replay" not in text


def test_routing_replay_rollout_of_episodes_is_refused(moe_folder):
    text = _problems(moe_folder, "model.moe_routing_replay=rollout", "rollout.engine=hf", "multi_turn.enable=true")
    assert "model.moe_routing_replay = rollout with multi_turn.enable" in text


def test_routing_replay_refusals_name_the_field(moe_folder):
    text = _problems(moe_folder, "model.moe_routing_replay=old", "parallel.engine=fsdp",
                     "parallel.recompute_granularity=full")
    assert "model.moe_routing_replay = old needs parallel.engine = megatron (got fsdp)" in text
    assert "parallel.recompute_granularity = full is not built" in text


def test_routing_replay_on_a_sigmoid_routed_model_is_refused_by_name(tmp_path):
    from verl_hpc.models.tiny import hf_config

    hf_config("deepseek_v3").save_pretrained(tmp_path)
    text = _problems(tmp_path, "model.moe_routing_replay=old")
    assert "model.moe_routing_replay = old with a sigmoid-routed model" in text and "DeepSeek-V3" in text
    assert "sigmoid-routed" not in _problems(tmp_path)  # replay off: no such line
