"""Split placement with reward.reward_model, for real: 1 rollout rank (vLLM) + 1 training rank. The
reward model lives on the training side (reward.reward_model.side = train_side), where the step scores
the responses it receives: a scorer's forward or a generative judge on HF generate, each step."""
import json
import math

import pytest
from jobs import data_overrides, run_job

SPLIT_DEMO = "configs/demo_rl_split.yaml"


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 1 and "actor/pg_loss" in r]


# the scorer's launch is in make test-long (a second 2-rank launch, 40 s): make test keeps the judge's,
# which runs the same training-side scoring path; a scorer model's job is tests/jobs/test_reward_model_job.py
@pytest.mark.parametrize("kind", [pytest.param("scorer", marks=pytest.mark.long), "judge"])
def test_split_job_scores_with_the_reward_model_on_the_training_side(tiny_assets, tmp_path, kind):
    from verl_hpc.models.tiny_reward import make_tiny_classifier

    scorer = make_tiny_classifier(tiny_assets / "model", tmp_path / "scorer", seed=11)
    rm = ([f"reward.reward_model.path={scorer}"] if kind == "scorer" else
          [f"reward.reward_model.path={tiny_assets}/model", "reward.reward_model.kind=judge",
           "reward.reward_model.judge.engine=hf", "reward.reward_model.judge.verdict=pattern",
           r"reward.reward_model.judge.pattern='(\d)'", "reward.reward_model.judge.max_failure_share=1"])
    out = tmp_path / kind
    args = [f"model.path={tiny_assets}/model", *data_overrides(tiny_assets), "trainer.total_steps=2",
            "trainer.val_every=0", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size=8", "rollout.engine=vllm", "slurm.cpus_per_task=1", "checkpoint.save_every=0",
            "reward.reward_model.enable=true", *rm]
    p, _ = run_job(SPLIT_DEMO, out, *args, ranks=2, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(out)
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["reward/rm/mean"])
        if kind == "judge":  # every verdict counted, parsed or not (max_failure_share 1: never stops)
            assert r["judge/parse_failures"] + r["judge/verdict_rate"] * 8 == pytest.approx(8)
