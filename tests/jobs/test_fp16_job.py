"""model.dtype = float16 through the real RL trainer (GRPO on the tiny model, one rank in this
process).

On this CPU: the actor trains in fp16, on the Megatron engine with Megatron's dynamic loss scaling,
on the FSDP engine (fsdp.mixed_precision = fp16) with torch's ShardedGradScaler (the rollout, HF
generate, runs fp32 on a CPU); every step reports `actor/loss_scale` and no non-finite step; the
job saves, stops and resumes, and the checkpoint carries the scale the step reported.

On a GPU (@pytest.mark.gpu; skipped here): the same job end to end in fp16 against bf16, the
rollout engine (vLLM where installed, else HF generate) and the weight sync in the job's dtype:
each engine (Megatron, FSDP) trains and resumes in fp16, and the trainer's own mismatch metric
(`rollout/logprob_diff_mean`, the rollout's log-probs against the actor's on the same tokens) is
smaller in fp16 than in bf16, the claim of "Defeating the training-inference mismatch via FP16".
"""
import pytest

from jobs import MOVING, grpo, logs, metrics


@pytest.fixture
def assets(tiny_assets):
    return tiny_assets


def _steps(out):
    return {r["step"]: r for r in metrics(out) if r.get("step", 0) >= 1}


def _train_and_resume(assets, out, *extra):
    """2 steps saved every step, then the same job to 3: it resumes from step 2."""
    common = ["model.dtype=float16", "checkpoint.save_every=1", *MOVING, *extra]
    proc, s = grpo(assets, out, "trainer.total_steps=2", *common)
    assert proc.returncode == 0, logs(proc, out)
    proc, s = grpo(assets, out, "trainer.total_steps=3", *common)
    assert proc.returncode == 0, logs(proc, out)
    assert s["resumed_from"] == 2 and s["steps"] == 3, s
    rows = _steps(out)
    assert sorted(rows) == [1, 2, 3]
    for step, row in rows.items():
        assert row["actor/loss_scale"] > 0 and row["actor/nonfinite_steps"] == 0, (step, row)
        assert row["actor/overflow_steps"] >= 0
    from verl_hpc.checkpoint import read_metadata

    engine = read_metadata(out / "checkpoints")["trainer_state"]["engines"]["actor"]
    assert engine["dtype"] == "float16"
    assert engine["grad_scaler"]["scale"] == rows[3]["actor/loss_scale"], engine["grad_scaler"]
    return rows


# the FSDP engine's auto compute dtype is fp32 on a CPU: fp16 is asked for
@pytest.mark.parametrize("engine", [["parallel.engine=megatron"], ["parallel.engine=fsdp", "fsdp.mixed_precision=fp16"]],
                         ids=["megatron", "fsdp"])
def test_fp16_job_trains_resumes_and_reports_its_loss_scale(assets, tmp_path, engine):
    rows = _train_and_resume(assets, tmp_path / "fp16", *engine)
    # 2^16 at the start: the tiny model's gradients stay finite under it, and the window (1000
    # steps) is far: the scale never moves in three steps
    assert [rows[k]["actor/loss_scale"] for k in (1, 2, 3)] == [65536.0] * 3
    assert all(rows[k]["actor/overflow_steps"] == 0 for k in rows)


GPU = ["slurm.gpus_per_node=1", "rollout.engine=auto", "rollout.gpu_memory_utilization=0.2"]


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["megatron", "fsdp"])
def test_fp16_on_a_gpu_trains_resumes_and_narrows_the_mismatch(assets, tmp_path, engine):
    which = [f"parallel.engine={engine}"]
    rows16 = _train_and_resume(assets, tmp_path / "fp16", *GPU, *which)
    proc, _ = grpo(assets, tmp_path / "bf16", "model.dtype=bfloat16", "trainer.total_steps=3", *MOVING, *GPU, *which)
    assert proc.returncode == 0, logs(proc, tmp_path / "bf16")
    rows16_gap = [r["rollout/logprob_diff_mean"] for r in rows16.values()]
    rows_bf16 = _steps(tmp_path / "bf16")
    assert all("actor/loss_scale" not in r for r in rows_bf16.values())  # bf16 has no scaler
    bf16_gap = [r["rollout/logprob_diff_mean"] for r in rows_bf16.values()]
    assert sum(rows16_gap) / len(rows16_gap) < sum(bf16_gap) / len(bf16_gap), (rows16_gap, bf16_gap)
