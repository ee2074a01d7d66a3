"""LoRA in the Megatron engine on one gloo rank, against Hugging Face peft (tests/lora_reference.py):
forward log-probs, adapters off = the base model bitwise, only the adapters train, PEFT export and
load round trip, the merged export, and adapter-only engine state. The TP/PP layouts are in
tests/dist/engines/test_eng_lora_parity.py."""
import pytest
import torch

from lora_reference import HF_TARGETS, peft_logits, random_adapter

RANK, ALPHA = 4, 8.0


def _batch(seed=0, n=4):
    from verl_hpc.engines.batch import pack_sequences

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 480, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    resps = [torch.randint(5, 480, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    return pack_sequences(prompts, resps)


def _hf_logps(logits, batch):
    from verl_hpc.engines.batch import get_response_mask, response_positions, response_tokens

    mask = get_response_mask(batch)
    pos = response_positions(batch["prompt_lengths"], mask.shape[1], batch["input_ids"].shape[1])
    rows = torch.log_softmax(logits[torch.arange(len(pos)).unsqueeze(1), pos], dim=-1)
    tok = response_tokens(batch["input_ids"], batch["prompt_lengths"], mask.shape[1])
    return rows.gather(-1, tok.unsqueeze(-1)).squeeze(-1) * mask


@pytest.fixture
def setup(one_rank_world, tmp_path):
    from verl_hpc.config.schema import LoraConfig, OptimConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    init_model_parallel(1, 1)
    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    optim = OptimConfig(lr=0.05, eps=1.0, weight_decay=0.0)
    eng = MegatronEngine(default_options(model_path=str(model), lora=lora, optim=optim, micro_batch_size=2))
    return model, eng


def test_a_fresh_adapter_changes_nothing_and_adapters_off_is_the_base_bitwise(setup):
    from verl_hpc.models.lora import load_adapter

    model, eng = setup
    batch = _batch()
    fresh = eng.forward(batch, ("log_probs",))["log_probs"]
    with eng.adapters_off():
        base = eng.forward(batch, ("log_probs",))["log_probs"]
    assert torch.equal(fresh, base)  # B = 0
    load_adapter(eng.gpt_chunks, random_adapter(model, RANK, ALPHA))
    adapted = eng.forward(batch, ("log_probs",))["log_probs"]
    with eng.adapters_off():
        off = eng.forward(batch, ("log_probs",))["log_probs"]
    assert torch.equal(off, base)
    assert (adapted - base).abs().max() > 1e-3


def test_forward_matches_peft(setup):
    from verl_hpc.models.lora import load_adapter

    model, eng = setup
    adapter = random_adapter(model, RANK, ALPHA)
    load_adapter(eng.gpt_chunks, adapter)
    batch = _batch(1)
    got = eng.forward(batch, ("log_probs",))["log_probs"]
    want = _hf_logps(peft_logits(model, adapter, RANK, ALPHA, tuple(HF_TARGETS), batch["input_ids"]), batch)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


def test_export_round_trips_and_merged_export_is_peft_merge(setup):
    from verl_hpc.models.lora import load_adapter
    from lora_reference import peft_model
    from peft import set_peft_model_state_dict

    model, eng = setup
    adapter = random_adapter(model, RANK, ALPHA)
    load_adapter(eng.gpt_chunks, adapter)
    exported = {n: t.clone() for n, t in eng.export_adapter()}
    assert exported.keys() == adapter.keys()
    for name, t in adapter.items():
        assert torch.equal(exported[name], t), name
    cfg = eng.adapter_config()
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA
    assert sorted(cfg["target_modules"]) == sorted(m for ms in HF_TARGETS.values() for m in ms)

    ref = peft_model(model, RANK, ALPHA, tuple(HF_TARGETS), dtype=torch.float32)
    set_peft_model_state_dict(ref, adapter)
    merged = ref.merge_and_unload().state_dict()
    got = dict(eng.export_hf_weights())
    for name, t in got.items():
        torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=1e-6, msg=name)
    with eng.adapters_off():  # the base weights, as loaded
        from safetensors.torch import load_file

        base = load_file(str(next(model.glob("*.safetensors"))))
        for name, t in eng.export_hf_weights():
            assert torch.equal(t, base[name]), name


def test_only_the_adapters_train(setup):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.megatron import Actor
    from verl_hpc.models.lora import adapter_parameters

    model, eng = setup
    adapters = {id(p) for p in adapter_parameters(eng.gpt_chunks)}
    before = {n: p.detach().clone() for g in eng.gpt_chunks for n, p in g.named_parameters()}
    trainable = [p for g in eng.gpt_chunks for p in g.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == adapters
    optimized = [p for o in eng.optimizer.chained_optimizers for grp in o.optimizer.param_groups
                 for p in grp["params"]]
    assert sum(p.numel() for p in optimized) == sum(p.numel() for p in trainable)

    from verl_hpc.engines.batch import get_response_mask

    batch = _batch(2, n=4)
    g = torch.Generator().manual_seed(5)
    acfg = ActorConfig(ppo_mini_batch_size=4)
    actor = Actor(eng, acfg)
    batch = dict(batch, advantages=torch.randn(get_response_mask(batch).shape, generator=g),
                 old_log_probs=actor.log_probs(batch)["old_log_probs"])
    metrics = actor.update(batch, PolicyObjective.from_config(acfg))
    assert metrics["actor/nonfinite_steps"] == 0.0
    assert eng.adapter_version == 1
    changed = {n for g in eng.gpt_chunks for n, p in g.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.endswith((".lora_A", ".lora_B")) for n in changed), changed


def test_state_holds_the_adapters_only_and_names_its_base(setup, tmp_path):
    from verl_hpc.engines.megatron.lora import check_state_meta

    model, eng = setup
    st = eng.state()
    names = {t.name for t in st.tensors}
    assert names and all(".lora_" in n for n in names), sorted(names)[:5]
    assert any(n.endswith("linear_fc1.lora_B/gate") for n in names)  # layout-independent gate/up
    assert st.meta["lora"]["rank"] == RANK and len(st.meta["lora"]["base_fingerprint"]) == 64
    check_state_meta(st.meta["lora"], eng.lora, str(model))  # the same base: accepted
    other = tmp_path / "other"
    other.mkdir()
    for f in model.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = (other / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ')
    (other / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="point model.path at that base"):
        check_state_meta(st.meta["lora"], eng.lora, str(other))
    with pytest.raises(ValueError, match="lora.rank = 0"):
        check_state_meta(st.meta["lora"], None, str(model))


def test_a_layernorm_fused_linear_feeds_its_adapter_the_normalised_input():
    """Transformer Engine's LayerNorm-linear layers (GPU) take the raw input and normalise inside:
    the adapter must multiply what the weight multiplies. The rule itself is plain torch."""
    from types import SimpleNamespace

    from verl_hpc.models.lora import _adapter_input

    x = torch.randn(3, 2, 8)
    w = torch.rand(8) + 0.5
    plain = SimpleNamespace()
    assert _adapter_input(plain, x) is x  # the local spec: its norm is a module of its own
    fused = SimpleNamespace(layer_norm_weight=w, config=SimpleNamespace(
        normalization="RMSNorm", layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=False))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(_adapter_input(fused, x), want)
    fused.config.layernorm_zero_centered_gamma = True  # the stored weight is gamma - 1
    fused.layer_norm_weight = w - 1
    torch.testing.assert_close(_adapter_input(fused, x), want)


def test_init_from_a_peft_folder(setup, tmp_path):
    """lora.init_from: the engine starts from a PEFT adapter folder (e.g. an SFT run's export) and
    computes what that adapter loaded by hand computes; a folder of another rank is one error line."""
    import json

    from safetensors.torch import save_file

    from verl_hpc.config import ConfigError
    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.lora import load_adapter, peft_config

    model, eng = setup
    adapter = random_adapter(model, RANK, ALPHA, seed=9)
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({k: v.clone() for k, v in adapter.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(peft_config(RANK, ALPHA, tuple(HF_TARGETS))))
    load_adapter(eng.gpt_chunks, adapter)
    batch = _batch(4)
    want = eng.forward(batch, ("log_probs",))["log_probs"]
    started = MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(
        rank=RANK, alpha=ALPHA, init_from=str(folder)), micro_batch_size=2))
    assert torch.equal(started.forward(batch, ("log_probs",))["log_probs"], want)
    with pytest.raises(ConfigError, match=r"lora.init_from: .* has r = 4 .* this job has lora.rank = 8"):
        MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(rank=8, init_from=str(folder))))
    with pytest.raises(ConfigError, match="not a readable PEFT adapter folder"):
        MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(rank=RANK, init_from=str(tmp_path))))
