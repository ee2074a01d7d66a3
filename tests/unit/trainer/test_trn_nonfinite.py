"""A NaN loss through the real RL trainer in this process (one gloo rank, the tiny model, the HF
rollout, the real Megatron actor): the actor skips the update and says so, the step is counted,
the count goes back to 0 after a finite step, and N NaN steps in a row stop the run naming
trainer.max_nonfinite_in_a_row. The NaN comes from the test: the advantage stage is wrapped to
return NaN advantages at chosen steps, so the policy loss is NaN there."""
import json
import types

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPTS = {"1+2=": "3", "2+2=": "4", "3+4=": "7", "5+1=": "6"}


def _trainer(tmp_path, model, nan_steps, *overrides):
    from verl_hpc.config import load_config
    from verl_hpc.trainer.programs.rl import RLTrainer

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "data_source": "synthetic_arith", "ground_truth": a})
                            + "\n" for p, a in PROMPTS.items()))
    cfg = load_config(None, [f"model.path={model}", "model.dtype=float32", f"data.train_files=[{data}]",
                             "data.train_batch_size=4", "data.max_prompt_length=16", "data.max_response_length=4",
                             "algorithm.recipe=grpo", "actor.use_kl_loss=false", "rollout.engine=hf", "rollout.n=2",
                             "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=2", "trainer.val_every=0",
                             "tracking.backends=[jsonl]", f"trainer.output_dir={tmp_path}/out", *overrides])
    ctx = types.SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                                generator=torch.Generator().manual_seed(0),
                                preemption=types.SimpleNamespace(agreed=lambda: False))
    trainer = RLTrainer(cfg, ctx)
    advantage, calls = trainer.advantage, []

    def nan_at_chosen_steps(batch):  # called once a step (GRPO: no filter empties a step)
        calls.append(1)
        m = advantage(batch)
        if len(calls) in nan_steps:
            batch.advantages = torch.full_like(batch.advantages, float("nan"))
        return m

    trainer.advantage = nan_at_chosen_steps
    return trainer


def _rows(tmp_path):
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r.get("step", 0) >= 1}


def test_trn_a_nan_step_is_skipped_counted_and_the_run_goes_on(one_rank_world, tmp_path, tiny_model):
    trainer = _trainer(tmp_path, tiny_model, {2}, "trainer.total_steps=3")
    summary = trainer.fit()
    rows = _rows(tmp_path)
    assert summary["steps"] == 3 and summary["stopped"] == "completed"
    assert rows[1]["actor/nonfinite_steps"] == 0 and rows[1]["train/nonfinite_in_a_row"] == 0
    assert rows[2]["actor/nonfinite_steps"] > 0 and rows[2]["train/nonfinite_in_a_row"] == 1
    assert rows[3]["train/nonfinite_in_a_row"] == 0
    assert summary["nonfinite_total"] == 1
    # the summary's keys, in order (rl_summary.json, RL_RESULT; rollbacks / stop_reason only when they happen)
    assert list(summary) == ["steps", "stopped", "val_before", "val_after", "resumed_from", "restarts", "total_steps",
                             "reward_mean", "history",
                             "seconds", "plot", "metrics_file", "nonfinite_total"]


def test_trn_nan_steps_in_a_row_stop_the_run(one_rank_world, tmp_path, tiny_model):
    from verl_hpc.trainer.hooks.guard import NonFiniteError

    trainer = _trainer(tmp_path, tiny_model, {2, 3, 4}, "trainer.total_steps=5", "trainer.max_nonfinite_in_a_row=2")
    with pytest.raises(NonFiniteError) as err:
        trainer.fit()
    assert "non-finite loss or grad norm in 2 steps in a row" in str(err.value)
    assert "trainer.max_nonfinite_in_a_row=2" in str(err.value)
    assert str(err.value).startswith("step 3:")  # the second NaN step in a row, not later
    assert sorted(_rows(tmp_path)) == [1, 2]  # the failing step is not logged
