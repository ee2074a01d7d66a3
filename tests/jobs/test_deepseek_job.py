"""A GRPO job on a tiny DeepSeek-V3 (models/deepseek.py: latent attention, the biased sigmoid router,
grouped top-k, a shared expert, a dense first layer) through the user's entry point on the Megatron
engine, two steps with HF rollout: after every weight sync the rollout holds exactly the training
engine's exported weights (the router's e_score_correction_bias included), the update moves the
weights, and the router's bias moves by Megatron's rule (a multiple of the update rate per step,
towards the less loaded experts), and the trainer's checkpoint keeps the moved bias."""
import torch

from jobs import MOVING, logs, read_all, run_here, small

RATE = 0.01


def test_deepseek_v3_grpo_job_on_megatron(tiny_assets, tmp_path, monkeypatch):
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.resharding.sync import WeightSync

    model = make_tiny_model(tmp_path / "ds", "deepseek_v3", seed=5)
    sync, seen = WeightSync.__call__, []

    def checked(self, actor, rollout):
        out = sync(self, actor, rollout)
        want = {n: t.detach().clone() for n, t in actor.engine.export_hf_weights()}
        got = rollout.model.state_dict()
        seen.append(dict(state=want, differ=[n for n in want if n in got and not torch.equal(got[n], want[n])],
                         missing=[n for n in want if n not in got and ".mlp.experts." not in n]))
        return out

    monkeypatch.setattr(WeightSync, "__call__", checked)
    out = tmp_path / "out"
    proc, summary = run_here("configs/demo_rl.yaml", out, *small(
        tiny_assets, f"model.path={model}", "parallel.engine=megatron", "trainer.total_steps=2",
        "data.train_batch_size=2", "rollout.n=2", "tracking.backends=[jsonl]", "tracking.plots=false",
        "slurm.cpus_per_task=1", f"model.moe_router_bias_update_rate={RATE}", "checkpoint.save_every=2", *MOVING))
    assert proc.returncode == 0, logs(proc, out)
    assert summary["steps"] == 2 and len(seen) == 2
    assert [(s["differ"], s["missing"]) for s in seen] == [([], []), ([], [])]
    first, second = seen[0]["state"], seen[1]["state"]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in first
    moved = [n for n in first if not torch.equal(first[n], second[n])]
    assert "model.layers.1.self_attn.kv_b_proj.weight" in moved and "model.layers.0.mlp.gate_proj.weight" in moved
    # one optimizer step between the two syncs: each expert's bias moved by -rate, 0 or +rate
    step = (second[bias] - first[bias]) / RATE
    assert torch.allclose(step, step.round(), atol=1e-4) and set(step.round().tolist()) <= {-1.0, 0.0, 1.0}
    assert step.abs().sum() > 0, "the bias update rule did not run"
    # the trainer's checkpoint keeps the moved bias (a resumed run routes as the saved one did)
    saved = {n: t for n, t in read_all(out / "checkpoints" / "step_000002").items() if n.endswith("expert_bias")}
    assert list(saved) == ["actor/model/decoder.layers.1.mlp.router.expert_bias"], sorted(saved)
    assert not torch.equal(saved["actor/model/decoder.layers.1.mlp.router.expert_bias"].float(), first[bias])
