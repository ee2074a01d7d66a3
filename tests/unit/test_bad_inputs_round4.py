"""Bad inputs of the fourth hardening round (issue 67, items 4-13): each refused before the queue
with one line naming the field, file or row and what is valid, or accepted where the docs say it
is valid. Tiny folders come from the shared fixtures (tests/conftest.py)."""
import pytest

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.rewards import RewardError
from verl_hpc.rewards.scorer import RewardScorer

from tests.unit.test_bad_inputs import one_line

GDPO = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2", "algorithm.adv_estimator=gdpo",
        "reward.custom_function=x.py:f", "safety.allow_custom_code=true"]


def problems(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides), check_model=False)
    return str(e.value)


# ------------------------------------------------------------------ item 4: GDPO weights, keys, loss scale
@pytest.mark.parametrize("weight", [".nan", ".inf", "-.inf"])
def test_gdpo_weights_must_be_finite(weight):
    text = problems(GDPO + ["algorithm.gdpo_reward_keys=[fmt,acc]", f"algorithm.gdpo_reward_weights=[{weight},1]"])
    assert one_line(text).startswith("algorithm.gdpo_reward_weights: must be finite numbers, got ["), text


def test_a_non_finite_float_in_any_list_field_is_refused():
    text = problems(GDPO[:4] + ["actor.optim.betas=[0.9,.nan]"])
    assert "actor.optim.betas: must be finite numbers, got [0.9, nan]" in text


def test_gdpo_reward_key_given_twice_is_refused():
    text = problems(GDPO + ["algorithm.gdpo_reward_keys=[fmt,fmt]"])
    assert one_line(text).startswith("algorithm.gdpo_reward_keys names 'fmt' more than once"), text
    validate(load_config(None, GDPO + ["algorithm.gdpo_reward_keys=[fmt,acc]"]), check_model=False)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_an_absurd_initial_loss_scale_is_refused_with_the_range(role):
    text = problems(GDPO[:4] + [f"{role}.optim.initial_loss_scale=1e300"])
    assert one_line(text).startswith(f"{role}.optim.initial_loss_scale = 1e+300: valid (0, 2**32]"), text
    validate(load_config(None, GDPO[:4] + [f"{role}.optim.initial_loss_scale={2**32}"]), check_model=False)


# ------------------------------------------------------------------ item 10: a GDPO component past float32
def test_a_gdpo_component_beyond_float32_names_the_key_and_the_sample():
    scorer = RewardScorer(on_error="raise", gsm8k_method="strict",
                          custom_function=lambda ds, text, truth, extra: {"score": 1.0, "fmt": 1e39})
    with pytest.raises(RewardError) as e:
        scorer.score_with_components(["p7:1"], ["x"], ["a"], ["a"], keys=["fmt", "score"])
    text = one_line(e.value)
    assert "returned 'fmt' = 1e+39; expected a finite number within float32's range (|fmt| <= " in text, text
    assert "for sample p7:1 (data_source 'x'" in text
