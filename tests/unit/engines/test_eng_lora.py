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
    from verl_hpc.models.lora import load_adapter
    from verl_hpc.models.lora_names import peft_config

    model, eng = setup
    adapter = random_adapter(model, RANK, ALPHA, seed=9)
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({k: v.clone() for k, v in adapter.items()}, str(folder / "adapter_model.safetensors"))
    config = peft_config(RANK, ALPHA, tuple(HF_TARGETS), use_rslora=False)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    load_adapter(eng.gpt_chunks, adapter)
    batch = _batch(4)
    want = eng.forward(batch, ("log_probs",))["log_probs"]
    started = MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(
        rank=RANK, alpha=ALPHA, init_from=str(folder)), micro_batch_size=2))
    assert torch.equal(started.forward(batch, ("log_probs",))["log_probs"], want)
    with pytest.raises(ConfigError, match=r"lora.init_from: .*: r = 4, this job has lora.rank = 8: set lora.rank = 4"):
        MegatronEngine(default_options(model_path=str(model),
                                       lora=LoraConfig(rank=8, alpha=ALPHA, init_from=str(folder))))
    with pytest.raises(ConfigError, match="has no adapter_config.json and no adapter_model.safetensors; valid: a PEFT"):
        MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(rank=RANK, init_from=str(tmp_path))))


def _init_from(model, folder, **lora):
    from verl_hpc.config.schema import LoraConfig, OptimConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options

    return MegatronEngine(default_options(model_path=str(model), micro_batch_size=2, lora=LoraConfig(
        rank=RANK, alpha=ALPHA, init_from=str(folder), **lora), optim=OptimConfig(lr=0.05, eps=1.0, weight_decay=0.0)))


@pytest.mark.parametrize("options", [{}, {"use_rslora": True}], ids=["stock", "rslora"])
def test_a_stock_peft_adapter_computes_what_peft_computes_before_and_after_training(setup, tmp_path, options):
    """An adapter written by stock PEFT (its own A for q, k, v and for gate, up), plain or rsLoRA
    (scale alpha / sqrt(r)): the engine's log-probs are PEFT's, its export is the file's tensors and
    PEFT's merge; after a PPO update the fused layers' A are still one per module (the block
    structure kept), and PEFT with the updated export computes the engine's log-probs again."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from lora_reference import peft_model, save_peft
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.batch import get_response_mask
    from verl_hpc.engines.megatron import Actor

    model, _ = setup
    folder = save_peft(model, tmp_path / "stock", RANK, ALPHA, **options)
    adapter = load_file(str(folder / "adapter_model.safetensors"))
    eng = _init_from(model, folder, **options)
    assert eng.lora.per_module_a
    qkv_a = next(t for t in eng.state().tensors if t.name.endswith("0.self_attention.linear_qkv.lora_A"))
    assert tuple(qkv_a.global_shape) == (3 * RANK, 128)  # q's, k's and v's A, one above the other
    batch = _batch(6)
    got = eng.forward(batch, ("log_probs",))["log_probs"]
    want = _hf_logps(peft_logits(model, adapter, RANK, ALPHA, tuple(HF_TARGETS), batch["input_ids"], **options), batch)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    exported = dict(eng.export_adapter())
    assert exported.keys() == adapter.keys() and all(torch.equal(exported[n], t) for n, t in adapter.items())
    assert eng.adapter_config()["use_rslora"] == bool(options)
    ref = peft_model(model, RANK, ALPHA, tuple(HF_TARGETS), dtype=torch.float32, tie_a=False, **options)
    set_peft_model_state_dict(ref, adapter)
    merged = ref.merge_and_unload().state_dict()
    for name, t in eng.export_hf_weights():
        torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=1e-6, msg=name)

    acfg = ActorConfig(ppo_mini_batch_size=4)
    actor = Actor(eng, acfg)
    g = torch.Generator().manual_seed(5)
    step = _batch(2, n=4)
    step = dict(step, advantages=torch.randn(get_response_mask(step).shape, generator=g),
                old_log_probs=actor.log_probs(step)["old_log_probs"])
    assert actor.update(step, PolicyObjective.from_config(acfg))["actor/nonfinite_steps"] == 0.0
    trained = {n: t.clone() for n, t in eng.export_adapter()}
    q, k = (f"base_model.model.model.layers.0.self_attn.{m}_proj.lora_A.weight" for m in "qk")
    assert not torch.equal(trained[q], adapter[q]) and not torch.equal(trained[k], adapter[k])
    assert not torch.equal(trained[q], trained[k])
    got = eng.forward(batch, ("log_probs",))["log_probs"]
    want = _hf_logps(peft_logits(model, trained, RANK, ALPHA, tuple(HF_TARGETS), batch["input_ids"], **options), batch)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


def test_a_damaged_or_nan_adapter_stops_the_rank_with_one_line(setup, tmp_path):
    """The rank's backstop for a job started without the submitter's checks: a truncated file and a
    NaN in a tensor are WeightFileError lines naming the file (and the tensor), not a safetensors
    traceback or a run that trains on NaN."""
    from safetensors.torch import load_file, save_file

    from lora_reference import save_peft
    from verl_hpc.models.hf_checkpoint import WeightFileError

    model, _ = setup
    folder = save_peft(model, tmp_path / "a", RANK, ALPHA)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    for n in list(tensors):  # one A per fused layer, as this project writes them
        for first, other in (("q_proj", "k_proj"), ("q_proj", "v_proj"), ("gate_proj", "up_proj")):
            if f".{other}.lora_A." in n:
                tensors[n] = tensors[n.replace(other, first)].clone()
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    tensors[name][2, 1] = float("nan")
    save_file(tensors, str(weights))
    with pytest.raises(WeightFileError, match=f"'{weights}': tensor '{name}' holds NaN or inf; valid: finite"):
        _init_from(model, folder)
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(WeightFileError, match=f"'{weights}' is not a readable safetensors file .*truncated or damaged"):
        _init_from(model, folder)


def test_resuming_under_another_scale_or_layout_is_refused(setup):
    """A checkpoint's adapters under another lora.alpha or lora.use_rslora would compute another
    model; under the other fused-A layout they would not fit: one line naming the field and both
    values (CheckpointLayoutError, exit code 23)."""
    import dataclasses

    from verl_hpc.checkpoint.errors import CheckpointLayoutError
    from verl_hpc.engines.megatron.lora import check_state_meta

    model, eng = setup
    saved = eng.state().meta["lora"]
    for change, words in (({"alpha": 16.0}, "have lora.alpha = 8.0, this job lora.alpha = 16.0: resume with the lora "
                                            "settings it was saved with (set lora.alpha = 8.0)"),
                          ({"use_rslora": True}, "have lora.use_rslora = false, this job lora.use_rslora = true"),
                          ({"per_module_a": True}, "hold one lora_A shared by q/k/v (gate/up), this job's one lora_A "
                                                   "per q/k/v (gate/up) module")):
        with pytest.raises(CheckpointLayoutError) as e:
            check_state_meta(saved, dataclasses.replace(eng.lora, **change), str(model))
        assert words in str(e.value) and "\n" not in str(e.value)
    old = {k: v for k, v in saved.items() if k not in ("use_rslora", "per_module_a")}  # written before they were
    check_state_meta(old, eng.lora, str(model))


def test_a_checkpoint_with_one_a_per_module_exports_the_peft_tensors(setup, tmp_path):
    """checkpoint export --peft of a run started from a stock PEFT adapter: the fused layers' A are
    split back into q's, k's and v's (gate's and up's), as the engine exports them."""
    from types import SimpleNamespace

    from lora_reference import save_peft
    from verl_hpc.checkpoint.hf_export import adapter_tensors

    model, _ = setup
    eng = _init_from(model, save_peft(model, tmp_path / "a", RANK, ALPHA))
    st = eng.state()
    held = {f"actor/{t.name}": t.local.clone() for t in st.tensors if t.name.startswith("model/")}
    reader = SimpleNamespace(path=tmp_path, tensors=lambda: list(held), load_tensor=held.__getitem__)
    got = dict(adapter_tensors(reader, eng.gpt_chunks[0].verl_arch, st.meta["lora"]))
    want = dict(eng.export_adapter())
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
