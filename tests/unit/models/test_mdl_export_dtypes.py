"""The full export across pipeline stages allocates each received tensor as its stage sends it: a
tensor whose dtype is not the model's (a sigmoid router's fp32 expert_bias in a bf16 model) arrives
in its own dtype. The other stage is faked (pp = 2 seen from stage 1, the broadcast recorded)."""
import torch


def test_a_receiving_stage_allocates_each_tensor_in_the_senders_dtype(one_rank_world, tmp_path, monkeypatch):
    from megatron.core import parallel_state as ps

    from verl_hpc.models import build_gpt_model, load_arch, load_hf_weights
    from verl_hpc.models import weights
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    folder = make_tiny_model(tmp_path / "model", "llama", layers=1)
    init_model_parallel(1, 1)
    model = build_gpt_model(load_arch(str(folder)))
    load_hf_weights(model, str(folder))
    norm = model.decoder.final_layernorm.weight
    norm.data = norm.data.double()  # one tensor in another dtype than the rest
    entries = weights._stage_entries(model)
    assert {d for *_, d in entries} == {torch.float32, torch.float64}
    assert weights.stage_entries(model)[0] == entries[0][:2]  # the public list keeps (name, shape)

    # stage 1 of 2 receives stage 0's plan (this model's), then its own: only the former is received
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: None)
    monkeypatch.setattr(weights.dist, "get_global_rank", lambda group, stage: stage)

    def gather_plans(plans, mine, group=None):
        plans[0], plans[1] = entries, []

    received = {}
    monkeypatch.setattr(weights.dist, "all_gather_object", gather_plans)
    monkeypatch.setattr(weights.dist, "broadcast", lambda t, src, group=None: received.setdefault(src, []).append(t))
    out = dict(weights.export_hf_weights(model))
    assert len(out) == len(entries) and len(received[0]) == len(entries)
    assert out["model.norm.weight"].dtype == torch.float64
    assert {t.dtype for name, t in out.items() if name != "model.norm.weight"} == {torch.float32}
    cast = dict(weights.export_hf_weights(model, dtype=torch.bfloat16))  # a cast export: every tensor cast
    assert {t.dtype for t in cast.values()} == {torch.bfloat16}
