"""Every recipe of the algorithm library runs 3 RL steps through the real trainer and logs finite
metrics. One rank in the test process (tests/jobs.py). (A NaN loss: tests/unit/trainer/test_trn_nonfinite.py.)"""
import collections
import json
import math

import pytest

from jobs import logs, metrics, run_here, small

from verl_hpc.tracking import write_plots
from verl_hpc.tracking.console import KEY_PREFIXES

SHOWN = ("reward/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
         "response_length/mean", "perf/tokens_per_s", "timing_s/step")
RECIPES = ["ppo", "grpo", "dr_grpo", "dapo", "rloo", "remax", "reinforce_pp", "gspo", "prime"]


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.check) if r == "grpo" else r
                                    for r in RECIPES])
def test_trn_recipe_runs_three_steps(recipe, tiny_assets, tmp_path):
    n = {"ppo": 1, "remax": 1, "reinforce_pp": 1}.get(recipe, 2)
    extra = [f"algorithm.recipe={recipe}", f"rollout.n={n}"]
    if recipe == "dapo":
        extra.append("algorithm.overlong_buffer.len=2")  # the recipe's 4096 > max_response_length
    if recipe == "prime":  # the random model answers nothing right: keep its all-wrong groups so the PRM trains
        extra += ["algorithm.accuracy_filter.low=0.0", "prm.ppo_mini_batch_size=2", "prm.micro_batch_size=2"]
    extra.append(f"trainer.rollout_data_dir={tmp_path}/samples")
    proc, summary = run_here("configs/demo_rl.yaml", tmp_path / "out", *small(tiny_assets, *extra))
    assert proc.returncode == 0, logs(proc, tmp_path / "out")
    rows = [r for r in metrics(tmp_path / "out") if r.get("step", 0) >= 1]
    assert summary["steps"] == 3 and len(rows) == 3
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert "timing_s/generate" in row and row["rollout/tokens_per_s"] > 0
        assert row["rollout/sequences"] == 4 * n  # train_batch_size prompts x rollout.n
        if not row.get("filter/empty_step"):  # DAPO may filter every group of a tiny batch
            assert "timing_s/update_actor" in row
            assert "rollout/logprob_diff_max" in row and "actor/pg_loss" in row
            assert row["sync/bytes"] > 0 and row["sync/buckets"] >= 1  # resharding.sync ran
            for key in SHOWN:  # the console table and the plots show names the trainer emits
                assert key in row and key in KEY_PREFIXES, key
            # the share of rows with all-zero advantages left out of the actor update, every step
            assert 0.0 <= row["actor/zero_adv_skipped_share"] <= 1.0, row
        _check_dump(tmp_path / "samples" / f"step_{row['step']:06d}.jsonl", row, n)
    panels = write_plots(rows, tmp_path / "curves.png").panels
    trained = any("actor/entropy" in r for r in rows)  # DAPO may filter every step of a tiny run
    assert {"Reward", "Response length"} | ({"Entropy"} if trained else set()) <= set(panels), panels
    if recipe == "dapo":  # the filter ran and said what it dropped
        assert all("filter/dropped_groups" in r or "filter/kept_groups" in r for r in rows), rows[0]
    if recipe == "ppo":
        assert any("critic/vf_loss" in r for r in rows) and any("timing_s/values" in r for r in rows)
    if recipe in ("ppo", "rloo", "remax", "reinforce_pp"):
        assert any("reward/kl" in r for r in rows)  # KL in the reward through the controller
    if recipe == "prime":  # the implicit PRM scored, trained and rewarded every step; the filter reported
        assert all("prm/ce_loss" in r and "prm/token_reward_mean" in r and "timing_s/update_prm" in r
                   and "filter/acc_filtered_share" in r for r in rows), rows[0]
        assert "Implicit PRM" in panels


# issue 56's policy losses and estimators, each on the grpo recipe through the real trainer
THIRD_WAVE = [*(("actor.policy_loss", n) for n in ("sapo", "dppo_tv", "dppo_kl", "dro", "icepop", "m2po")),
              *(("algorithm.adv_estimator", n) for n in ("gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"))]
# a metric each one logs (the loss's own, or what its stage adds), in every step that trained
OWN_METRIC = {"sapo": "actor/sapo_weight_mean", "dppo_tv": "actor/pg_truncfrac", "dppo_kl": "actor/pg_truncfrac",
              "dro": "actor/ppo_kl", "icepop": "actor/icepop_masked_frac", "m2po": "m2po/masked_frac",
              "gdpo": "actor/pg_clipfrac", "optimal_token_baseline": "timing_s/old_logprob",
              "tir_optimal_token_baseline": "timing_s/old_logprob"}


@pytest.mark.parametrize("field, name", THIRD_WAVE)
def test_trn_third_wave_runs_three_steps(field, name, tiny_assets, tmp_path):
    """3 finite steps with each new name, learning from something (the random model scores 0 on the
    task: a reward with a component that varies gives the groups advantages); GDPO on its two
    components."""
    extra = ["algorithm.recipe=grpo", "rollout.n=2", f"{field}={name}", "safety.allow_custom_code=true",
             "reward.custom_function=task_rewards:score_and_checksum"]
    if name == "gdpo":
        extra += ["algorithm.gdpo_reward_keys=[accuracy,checksum]", "algorithm.gdpo_reward_weights=[1.0,0.5]"]
    proc, summary = run_here("configs/demo_rl.yaml", tmp_path / "out", *small(tiny_assets, *extra))
    assert proc.returncode == 0, logs(proc, tmp_path / "out")
    rows = [r for r in metrics(tmp_path / "out") if r.get("step", 0) >= 1]
    assert summary["steps"] == 3 and len(rows) == 3
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert "actor/pg_loss" in row and OWN_METRIC[name] in row, sorted(row)
    assert any(r["actor/grad_norm"] > 0 for r in rows)  # something was learned from


# multi_turn: episodes of two model turns with environment tokens between (tests/agent_env.py)
EPISODES = ["multi_turn.enable=true", "multi_turn.environment=agent_env:OneMoreTurn", "safety.allow_custom_code=true",
            "data.max_response_length=64", "rollout.max_tokens=8"]


@pytest.mark.parametrize("recipe", ["ppo", "grpo"])
def test_trn_recipe_over_episodes(recipe, tiny_assets, tmp_path):
    """PPO (the critic on the model's tokens) and GRPO over groups of episodes, with dynamic batching
    and the rollout-correction weights: 3 finite steps, every episode two model turns, environment
    tokens in the sequences but out of the loss (the mask's model share < 1), the dump's episodes."""
    extra = [f"algorithm.recipe={recipe}", f"rollout.n={1 if recipe == 'ppo' else 2}", *EPISODES,
             "actor.max_tokens_per_microbatch=200", "critic.max_tokens_per_microbatch=200",
             "algorithm.rollout_correction.rollout_is=token", f"trainer.rollout_data_dir={tmp_path}/samples"]
    proc, summary = run_here("configs/demo_rl.yaml", tmp_path / "out", *small(tiny_assets, *extra))
    assert proc.returncode == 0, logs(proc, tmp_path / "out")
    rows = [r for r in metrics(tmp_path / "out") if r.get("step", 0) >= 1]
    assert summary["steps"] == 3 and len(rows) == 3
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["episode/turns_mean"] == 2.0 and 0 < row["episode/model_token_share"] < 1
        assert "actor/pg_loss" in row and (recipe != "ppo" or "critic/vf_loss" in row)
        dumped = [json.loads(x) for x in (tmp_path / "samples" / f"step_{row['step']:06d}.jsonl").read_text().splitlines()]
        assert all(d["turns"] == 2 and 0 in d["response_mask"] and "<|im_start|>user" in d["episode"] for d in dumped)


def _check_dump(path, row, n):
    """trainer.rollout_data_dir: the step's samples, as scored (round 0 is what reward/* describes)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    first = [x for x in lines if x["round"] == 0]
    assert len(first) == row["rollout/sequences"] and {x["step"] for x in lines} == {row["step"]}
    assert sorted(collections.Counter(x["id"] for x in first).values()) == [n] * (len(first) // n)
    assert all(x["response_ids"] and x["finish"] in ("stop", "length") for x in first)
    assert sum(x["score"] for x in first) / len(first) == pytest.approx(row["reward/score/mean"], abs=1e-6)
