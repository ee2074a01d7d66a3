"""LoRA in the FSDP engine (PEFT's model, sharded) on one gloo rank, against Hugging Face peft itself:
the fresh adapter is the Megatron engine's, two updates equal PEFT's own training steps with torch's
AdamW, the save path's PEFT folder loads with PeftModel.from_pretrained and gives the engine's
logits, adapters off is the base, a PEFT-written adapter (untied q/k/v, rsLoRA, DoRA) starts a run
through lora.init_from, misfitting ones are one line, and checkpoints hold the adapters only."""
import json
from types import SimpleNamespace

import pytest
import torch

from lora_reference import HF_TARGETS, peft_model, save_peft

RANK, ALPHA = 4, 8.0
IDS = torch.tensor([[3, 17, 42, 99, 7, 250, 31, 5], [8, 120, 6, 77, 301, 2, 9, 14]])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("fsdp_lora") / "model", "llama", layers=2)


def _engine(model, **lora):
    from verl_hpc.config.schema import LoraConfig, OptimConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    optim = OptimConfig(lr=0.01, weight_decay=0.1, clip_grad=0.0)
    return FsdpEngine(default_options(str(model), engine="fsdp", micro_batch_size=2, optim=optim,
                                      lora=LoraConfig(rank=RANK, alpha=ALPHA, **lora)))


def _logits(eng, ids=IDS):
    eng.model.eval()
    with torch.no_grad():
        return eng.model(input_ids=ids, use_cache=False).logits


def _batch(seed):
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 480, (int(n),), generator=g).tolist() for n in (3, 5, 2, 4)]
    resps = [torch.randint(5, 480, (int(n),), generator=g).tolist() for n in (4, 2, 6, 3)]
    batch = pack_sequences(prompts, resps)
    mask = get_response_mask(batch)
    return dict(batch, response_mask=mask, advantages=torch.randn(mask.shape, generator=g))


def _loss(out, data, counts):
    """A policy-gradient-like loss: the micro-batch's contribution to the batch's token mean."""
    return -(out["log_probs"] * data["advantages"] * data["response_mask"]).sum() / counts.tokens, {}


def _reference_loss(model, batch):
    from verl_hpc.engines.batch import response_positions, response_tokens

    mask = batch["response_mask"]
    logits = model(input_ids=batch["input_ids"]).logits
    pos = response_positions(batch["prompt_lengths"], mask.shape[1], batch["input_ids"].shape[1])
    logp = torch.log_softmax(logits[torch.arange(len(pos)).unsqueeze(1), pos].float(), dim=-1)
    tok = response_tokens(batch["input_ids"], batch["prompt_lengths"], mask.shape[1])
    logp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return -(logp * batch["advantages"] * mask).sum() / mask.sum()


def test_two_updates_equal_peft_training_steps_and_only_the_adapters_move(one_rank_world, base):
    eng = _engine(base)
    trainable = [p for p in eng.model.parameters() if p.requires_grad]
    optimized = [p for g in eng.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in trainable}
    assert sum(p.numel() for p in trainable) == sum(t.numel() for _, t in eng.export_adapter())
    base_before = {n: t.clone() for n, t in eng.hf_named_parameters() if ".lora_" not in n}

    ref = peft_model(base, RANK, ALPHA, tuple(HF_TARGETS), dtype=torch.float32, tie_a=False)
    from peft import set_peft_model_state_dict

    start = {n: t.clone() for n, t in eng.export_adapter()}
    assert not set_peft_model_state_dict(ref, start).unexpected_keys
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for step in range(2):  # the first moves B only (A's gradient is 0 while B = 0), the second both
        batch = _batch(step)
        metrics = eng.train_step(batch, _loss)
        opt.zero_grad()
        loss = _reference_loss(ref, batch)
        loss.backward()
        opt.step()
        assert metrics["nonfinite"] == 0.0 and abs(metrics["loss"] - float(loss)) < 1e-6
    from peft import get_peft_model_state_dict

    want = get_peft_model_state_dict(ref)
    got = dict(eng.export_adapter())
    assert got.keys() == want.keys()
    worst = max((got[n] - want[n]).abs().max().item() for n in got)
    assert worst < 1e-5, worst
    moved = [n for n in got if not torch.equal(got[n], start[n])]
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    assert eng.adapter_version == 2
    after = dict(eng.hf_named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base_before.items())


def test_a_fresh_adapter_is_the_megatron_engines(one_rank_world, base):
    """Same trainer.seed, same start: B = 0 and every A equal to the Megatron engine's export (its
    fused layer's one A, which PEFT's q, k and v each start from)."""
    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.parallel import init_model_parallel

    fsdp = dict(_engine(base).export_adapter())
    init_model_parallel(1, 1)
    meg = dict(MegatronEngine(default_options(str(base), lora=LoraConfig(rank=RANK, alpha=ALPHA))).export_adapter())
    assert fsdp.keys() == meg.keys() and len(fsdp) == 2 * 2 * 7
    assert all(torch.equal(fsdp[n], meg[n]) for n in fsdp), [n for n in fsdp if not torch.equal(fsdp[n], meg[n])]
    assert all(t.abs().sum() > 0 for n, t in fsdp.items() if ".lora_A." in n)


def test_the_peft_export_loads_with_peft_and_gives_the_engines_logits(one_rank_world, base, tmp_path):
    """The save path (save_hf: the merged model + adapter/ from export_adapter and adapter_config):
    PeftModel.from_pretrained on the base, and the merged folder, compute the engine's logits; with
    the adapters off the engine is the base itself."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from verl_hpc.trainer.programs.base import save_hf

    eng = _engine(base)
    eng.train_step(_batch(0), _loss)
    eng.train_step(_batch(1), _loss)
    out = tmp_path / "hf"
    save_hf(eng, SimpleNamespace(rank=0), str(base), str(out))
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    mine = _logits(eng)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        plain = hf(input_ids=IDS).logits
        adapted = PeftModel.from_pretrained(hf, out / "adapter")(input_ids=IDS).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=IDS).logits
    assert (adapted - plain).abs().max() > 1e-3, "the trained adapter changes the logits"
    torch.testing.assert_close(mine, adapted, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)
    with eng.adapters_off():
        torch.testing.assert_close(_logits(eng), plain, atol=1e-5, rtol=0)
        files = load_file(str(base / "model.safetensors"))
        assert all(torch.equal(t, files[n]) for n, t in eng.export_hf_weights())


@pytest.mark.parametrize("options", [{}, {"use_rslora": True}, {"use_dora": True}], ids=["stock", "rslora", "dora"])
def test_init_from_an_adapter_peft_wrote(one_rank_world, base, tmp_path, options):
    """lora.init_from with an adapter PEFT's save_pretrained wrote (its own A for q, k and v;
    rsLoRA's alpha / sqrt(r); DoRA's magnitudes): the engine's logits are PeftModel's, the merged
    weights PEFT's merge_and_unload, the export the file's tensors; and it trains."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = save_peft(base, tmp_path / "adapter", RANK, ALPHA, **options)
    eng = _engine(base, init_from=str(folder), use_rslora=bool(options.get("use_rslora")))
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ref = PeftModel.from_pretrained(hf, folder)
    with torch.no_grad():
        want = ref(input_ids=IDS).logits
    torch.testing.assert_close(_logits(eng), want, atol=1e-5, rtol=0)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    exported = dict(eng.export_adapter())
    assert exported.keys() == saved.keys() and all(torch.equal(exported[n], t) for n, t in saved.items())
    assert eng.adapter_config()["use_dora"] == bool(options.get("use_dora"))
    merged = ref.merge_and_unload().state_dict()
    for name, t in eng.export_hf_weights():
        torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=1e-6, msg=name)
    metrics = eng.train_step(_batch(2), _loss)
    assert metrics["nonfinite"] == 0.0
    assert any(not torch.equal(t, saved[n]) for n, t in eng.export_adapter())


def test_init_from_a_misfit_is_one_line(one_rank_world, base, tmp_path):
    from verl_hpc.config import ConfigError
    from verl_hpc.models.tiny import make_tiny_model

    folder = save_peft(base, tmp_path / "adapter", RANK, ALPHA)
    with pytest.raises(ConfigError, match=r"lora.init_from: .*: r = 4, this job has lora.rank = 8: set lora.rank = 4$"):
        from verl_hpc.config.schema import LoraConfig
        from verl_hpc.engines.fsdp import FsdpEngine
        from verl_hpc.engines.options import default_options

        FsdpEngine(default_options(str(base), engine="fsdp", lora=LoraConfig(rank=8, alpha=ALPHA,
                                                                              init_from=str(folder))))
    with pytest.raises(ConfigError, match=r"its adapter is on down_proj, gate_proj, o_proj, up_proj \(linear_fc1, "
                                          r"linear_fc2, linear_proj\), outside this job's lora.target_modules"):
        _engine(base, init_from=str(folder), target_modules=["linear_qkv"])
    other = make_tiny_model(tmp_path / "wide", "llama", layers=2, hidden=64, heads=2, kv_heads=1)
    with pytest.raises(ConfigError, match=r"tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' "
                                          r"has shape \[4, 128\]; model.path's LlamaForCausalLM and its r imply "
                                          r"\[4, 64\] \(and \d+ more\): an adapter of another base model"):
        _engine(other, init_from=str(folder))
    qv = save_peft(base, tmp_path / "qv", RANK, ALPHA, targets=("linear_qkv",))
    eng = _engine(base, init_from=str(qv))  # a subset of the job's targets: PEFT adapts just those
    assert eng.lora.modules == ("k_proj", "q_proj", "v_proj")


def test_state_holds_the_adapters_only_and_refuses_other_settings(one_rank_world, base, tmp_path):
    import dataclasses

    from verl_hpc.checkpoint.errors import CheckpointLayoutError
    from verl_hpc.engines.megatron.lora import check_state_meta as megatron_check

    eng = _engine(base)
    st = eng.state()
    names = {t.name for t in st.tensors}
    assert names and all(".lora_" in n for n in names), sorted(names)[:4]
    assert "model/base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names
    assert any(n.startswith("optim/exp_avg_sq/") for n in names)
    meta = st.meta["lora"]
    assert meta["rank"] == RANK and meta["engine"] == "fsdp" and len(meta["base_fingerprint"]) == 64
    eng.check_lora_meta(meta)
    with pytest.raises(CheckpointLayoutError, match=r"have lora.alpha = 16.0, this job lora.alpha = 8.0"):
        eng.check_lora_meta(dict(meta, alpha=16.0))
    with pytest.raises(CheckpointLayoutError, match=r"holds the Megatron engine.s fused adapters .*: resume it with "
                                                   r"parallel.engine=megatron"):
        eng.check_lora_meta({k: v for k, v in meta.items() if k != "engine"})
    with pytest.raises(CheckpointLayoutError, match=r"holds the FSDP engine.s PEFT adapters .*: resume it with "
                                                   r"parallel.engine=fsdp"):
        megatron_check(meta, eng.lora.spec, str(base))  # the Megatron engine resuming it
    with pytest.raises(CheckpointLayoutError, match=r"modules = \['q_proj', 'v_proj'\]"):
        eng.check_lora_meta(dict(meta, modules=["q_proj", "v_proj"]))
    with pytest.raises(CheckpointLayoutError, match="point model.path at that base"):
        eng.check_lora_meta(dict(meta, base_fingerprint="0" * 64))
    assert dataclasses.asdict(eng.lora.spec)["per_module_a"]


def test_a_resumed_adapter_trains_on_bitwise(one_rank_world, base):
    """The engine state (adapters, Adam moments, step counts) into a fresh engine: its next update
    is the straight engine's, bitwise."""
    straight = _engine(base)
    straight.train_step(_batch(0), _loss)
    saved = {t.name: t.local.clone() for t in straight.state().tensors}
    meta = straight.state().meta
    resumed = _engine(base, init="gaussian")  # another start: everything must come from the state

    def load_into(slabs):
        assert {t.name for t in slabs} == saved.keys()
        for t in slabs:
            t.local.copy_(saved[t.name])

    resumed.load_state(load_into, meta)
    assert resumed.adapter_version == 1
    for eng in (straight, resumed):
        eng.train_step(_batch(1), _loss)
    a, b = dict(straight.export_adapter()), dict(resumed.export_adapter())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_before_the_queue_an_fsdp_job_takes_what_peft_computes(base, tmp_path):
    """The rank's early check (as the submitter's): a DoRA adapter starts an FSDP job, which loads
    it through PEFT, but not a Megatron one, nor an FSDP job whose vLLM rollout takes the adapter
    itself (vLLM's LoRA slots do not serve DoRA); a pissa init (it rewrites the base) is refused."""
    from verl_hpc.config import ConfigError, load_config
    from verl_hpc.job import check_weight_files

    dora = save_peft(base, tmp_path / "dora", RANK, ALPHA, use_dora=True)
    job = [f"model.path={base}", "lora.rank=4", "lora.alpha=8", f"lora.init_from={dora}"]
    check_weight_files(load_config(None, [*job, "parallel.engine=fsdp"]))
    with pytest.raises(ConfigError, match=r"use_dora = true \(DoRA: a learned magnitude"):
        check_weight_files(load_config(None, [*job, "parallel.engine=megatron"]))
    with pytest.raises(ConfigError, match=r"use_dora = true \(DoRA\), which vLLM's LoRA slots do not serve; set "
                                          r"lora.sync = merged"):
        check_weight_files(load_config(None, [*job, "parallel.engine=fsdp", "rollout.engine=vllm",
                                              "lora.sync=adapter"]))
    folder = save_peft(base, tmp_path / "pissa", RANK, ALPHA)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(dict(config, init_lora_weights="pissa")))
    with pytest.raises(ConfigError, match=r"init_lora_weights = 'pissa' rewrites the base model's weights"):
        check_weight_files(load_config(None, [*job[:3], f"lora.init_from={folder}", "parallel.engine=fsdp"]))


def test_lora_on_phi3s_fused_projections_exports_what_peft_loads(one_rank_world, tmp_path):
    """An architecture the Megatron mapping does not cover, with its own fused layers (Phi-3's
    qkv_proj and gate_up_proj): lora.target_modules map onto them, and after an update the PEFT
    folder gives the engine's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Phi3Config, Phi3ForCausalLM

    from verl_hpc.trainer.programs.base import save_hf

    config = Phi3Config(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(tmp_path / "phi3")
    eng = _engine(tmp_path / "phi3")
    assert eng.lora.modules == ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")
    eng.train_step(_batch(0), _loss)
    eng.train_step(_batch(1), _loss)
    save_hf(eng, SimpleNamespace(rank=0), str(tmp_path / "phi3"), str(tmp_path / "out"))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "phi3", dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=IDS).logits
        want = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter")(input_ids=IDS).logits
    assert (want - plain).abs().max() > 1e-4
    torch.testing.assert_close(_logits(eng), want, atol=1e-5, rtol=0)
