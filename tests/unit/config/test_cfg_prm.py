"""The prm section and PRIME's recipe: what auto turns on, and checks that name the field and what
is valid (the accuracy filter's band, the coefficients, the warm-up, pairwise needing groups)."""
import functools

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.validate import validate
from verl_hpc.trainer.roles import engine_options

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "algorithm.recipe=prime"]


problems = functools.partial(config_checks.refused, base=BASE)


def test_prime_recipe_turns_on_the_prm_the_reference_and_the_accuracy_filter():
    cfg = load_config(None, BASE)
    assert cfg.prm.enable and cfg.ref.enable and cfg.algorithm.accuracy_filter.enable
    assert cfg.prm.model_path == cfg.model.path == "/nonexistent"
    assert (cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.prm.beta, cfg.prm.update) == ("prime", 4, 0.05, "before")
    assert cfg.prm.optim.lr == 1e-6 and not cfg.critic.enable
    plain = load_config(None, ["algorithm.recipe=grpo", "actor.use_kl_loss=false"])
    assert not plain.prm.enable and not plain.ref.enable and not plain.algorithm.accuracy_filter.enable
    grpo_prm = load_config(None, ["algorithm.recipe=grpo", "actor.use_kl_loss=false", "prm.enable=true"])
    assert grpo_prm.prm.enable and grpo_prm.ref.enable  # the process reward under GRPO needs the reference


def test_engine_options_of_the_prm_role():
    cfg = load_config(None, [*BASE, "prm.model_path=/prm", "prm.micro_batch_size=2", "prm.param_offload=true"])
    o = engine_options(cfg, "prm")
    assert (o.model_path, o.head, o.trainable, o.micro_batch_size, o.param_offload) == ("/prm", "lm", True, 2, True)
    assert o.optim is cfg.prm.optim and o.lora is None
    frozen = engine_options(load_config(None, [*BASE, "prm.update=none"]), "prm")
    assert not frozen.trainable and frozen.optim is None


@pytest.mark.parametrize("overrides, wanted", [
    (["prm.enable=false"], "prm.enable = false, but algorithm.adv_estimator = prime"),
    (["ref.enable=false"], "ref.enable = false, but prm.enable needs the reference policy"),
    (["prm.process_coef=0", "prm.outcome_coef=0"], "prm.process_coef and prm.outcome_coef are both 0"),
    (["prm.warmup_steps=2", "prm.update=none"], "prm.warmup_steps trains the PRM alone, but prm.update = none"),
    (["prm.loss=pairwise", "rollout.n=1", "algorithm.accuracy_filter.enable=false", "algorithm.adv_estimator=gae",
      "prm.enable=true"], "prm.loss = pairwise compares responses to one prompt and needs rollout.n >= 2"),
    (["algorithm.accuracy_filter.low=0.9"], "algorithm.accuracy_filter.low = 0.9 is above algorithm.accuracy_filter.high"),
    (["rollout.n=1"], "algorithm.accuracy_filter needs rollout.n >= 2"),
    (["prm.ppo_mini_batch_size=3"], "prm.ppo_mini_batch_size = 3 does not divide data.train_batch_size"),
    (["prm.optim.min_lr=1", "prm.optim.lr=0.1"], "prm.optim.min_lr = 1.0 is above prm.optim.lr = 0.1"),
    (["placement.mode=split", "placement.rollout_ranks=1", "slurm.tasks_per_node=2"],
     "algorithm.filter_groups / algorithm.accuracy_filter with placement.mode = split: a step that refills"),
])
def test_checks_name_the_field(overrides, wanted):
    found = problems(*overrides)
    assert any(wanted in p for p in found), found


@pytest.mark.parametrize("override, field", [("prm.beta=0", "prm.beta"), ("prm.loss=dpo", "prm.loss"),
                                             ("prm.update=later", "prm.update"), ("prm.granularity=step", "prm.granularity"),
                                             ("prm.reward_norm=l2", "prm.reward_norm"),
                                             ("prm.process_loo=row", "prm.process_loo"),
                                             ("prm.process_coef=-1", "prm.process_coef"),
                                             ("algorithm.accuracy_filter.high=1.5", "algorithm.accuracy_filter.high")])
def test_field_errors(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(load_config(None, [*BASE, override]), check_model=False)


def test_correct_at_is_validations_and_the_labels_threshold():
    assert load_config(None, []).reward.correct_at == 1.0
    assert load_config(None, ["reward.correct_at=0.5"]).reward.correct_at == 0.5
