"""The third wave's fields (actor.tau_pos/tau_neg, dro_beta, icepop_low/high, m2_threshold;
algorithm.gdpo_reward_keys/weights): the combinations that cannot work are refused at load, each
naming the fields and what would be valid; the trainer's stages read them (which old-log-prob path a
loss or estimator needs, IcePop without the decoupled weights on top)."""
import functools

import pytest

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "algorithm.recipe=grpo",
        "actor.use_kl_loss=false"]
SPLIT = ["placement.mode=split", "placement.rollout_ranks=1", "slurm.tasks_per_node=2", "async_training.staleness=2"]


problems = functools.partial(config_checks.refused, base=BASE)
accepted = functools.partial(config_checks.accepted, base=BASE)


@pytest.mark.parametrize("overrides, wanted", [
    (["actor.policy_loss=icepop", "actor.icepop_low=5.0"], "actor.icepop_low = 5.0 must be < actor.icepop_high = 5.0"),
    (["actor.icepop_high=0"], "actor.icepop_high"),
    (["actor.tau_neg=0"], "actor.tau_neg"),
    (["actor.dro_beta=-1"], "actor.dro_beta"),
    (["actor.m2_threshold=0"], "actor.m2_threshold"),
    (["actor.policy_loss=icepop", "algorithm.rollout_correction.bypass_mode=true"],
     "actor.policy_loss = icepop compares pi_old with the rollout's log-probs, but algorithm.rollout_correction"),
    (["actor.policy_loss=m2po", *SPLIT, "async_training.objective=behaviour"],
     "actor.policy_loss = m2po compares pi_old with the rollout's log-probs, but async_training.objective"),
    (["actor.policy_loss=icepop", "algorithm.rollout_correction.rollout_is=token"],
     "set algorithm.rollout_correction.rollout_is and rollout_rs to null"),
    (["algorithm.gdpo_reward_keys=[score]"], "read by adv_estimator = gdpo only (got grpo)"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]", "algorithm.gdpo_reward_weights=[1.0]",
      "reward.custom_function=m:f", "safety.allow_custom_code=true"], "has 1 weight(s) for 2 reward component(s)"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt]"], "only a reward.custom_function"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[score]", "algorithm.use_kl_in_reward=true"],
     "algorithm.use_kl_in_reward would be dropped"),
    (["algorithm.adv_estimator=gdpo", "rollout.n=1"], "algorithm.adv_estimator = gdpo compares the responses"),
    (["algorithm.adv_estimator=optimal_token_baseline", "algorithm.rollout_correction.bypass_mode=true"],
     "reads sum_v pi_v^2 from the actor's old-log-prob forward"),
])
def test_refused_with_the_fields_named(overrides, wanted):
    got = problems(*overrides)
    assert any(wanted in p for p in got), got


def test_valid_settings_load():
    accepted("actor.policy_loss=icepop", "actor.icepop_low=0.2")
    accepted("actor.policy_loss=m2po", *SPLIT)
    accepted("actor.policy_loss=sapo", "actor.tau_pos=0.5", "actor.tau_neg=2.0")
    accepted("actor.policy_loss=dppo_kl", "actor.clip_ratio_low=0.05", "actor.clip_ratio_high=0.05")
    accepted("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[score,fmt]", "algorithm.gdpo_reward_weights=[1.0,0.5]",
             "reward.custom_function=m:f", "safety.allow_custom_code=true")
    accepted("algorithm.adv_estimator=tir_optimal_token_baseline")


class _Batch:
    def __len__(self):
        return 8


@pytest.mark.parametrize("overrides, path", [
    ([], "update"),
    (["actor.policy_loss=icepop"], "update"),  # per token: the update's own forward is pi_old
    (["actor.policy_loss=m2po"], "forward"),  # its mask is of the whole batch, before the update
    (["algorithm.adv_estimator=optimal_token_baseline"], "forward"),  # the advantages read pi_old
])
def test_old_log_prob_path(overrides, path):
    from verl_hpc.trainer.stages.correction import old_log_prob_path

    # one mini-batch of the step's 8 sequences, one epoch: on-policy unless something reads pi_old first
    cfg = accepted("data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", *overrides)
    got, why = old_log_prob_path(cfg, _Batch(), has_ref=False)
    assert got == path, why
