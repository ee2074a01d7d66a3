"""The FSDP engine's weight stream of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE) is
in the checkpoint's names: transformers 5 keeps a layer's experts fused in memory
(`mlp.experts.gate_up_proj`) and names Mixtral's `block_sparse_moe` `mlp`, while the folder, the
rollouts' loaders and the HF export hold one tensor per expert and matrix. On 552e1b0 the engine
sent its in-memory names, and every GRPO job of these families on the FSDP engine stopped at the
first weight sync (HF rollout: `the update lacks 26 of the model's 41 tensors`; vLLM:
`'model.layers.0.mlp.gate.weight' is not a weight of this model`), and DeepSeek-V3's too: its router's
`e_score_correction_bias` is a persistent buffer, a tensor of the folder, which the engine did not
send (`the update lacks 1 of the model's 41 tensors`). Found by tests/arch_matrix_run.py."""
import pytest
import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_weight_stream_is_the_folders_tensors_and_loads_into_the_hf_rollout(family, one_rank_world, tmp_path):
    from safetensors.torch import load_file

    from engine_states import engine, make_batch, update
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    folder = make_tiny_model(tmp_path / family, family, seed=21)
    stored = load_file(str(folder / "model.safetensors"))
    eng = engine("fsdp", folder)
    assert eng.exported_model is None  # the sliced sync would send the fused names: the full path splits them
    sent = dict(eng.export_hf_weights())
    assert sorted(sent) == sorted(stored)
    assert all(torch.equal(sent[n], stored[n]) for n in stored)  # before any update: the folder, exactly
    update(eng, make_batch(3))
    sent = {n: t.clone() for n, t in eng.export_hf_weights()}
    assert any(not torch.equal(sent[n], stored[n]) for n in stored if ".experts." in n)
    rollout = HFRollout(str(folder), **default_engine_args("hf", max_prompt_length=16, max_response_length=4))
    try:
        assert rollout.load_weights(iter(sent.items()))["tensors"] == len(sent)
        trained = {n: p.detach().full_tensor() for n, p in eng.model.named_parameters()}
        loaded = dict(rollout.model.named_parameters())
        assert sorted(loaded) == sorted(trained)  # the same in-memory layout: fused experts
        assert all(torch.equal(loaded[n], trained[n]) for n in trained)  # the update, every tensor in place
    finally:
        rollout.close()
