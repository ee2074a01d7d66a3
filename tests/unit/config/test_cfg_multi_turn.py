"""The multi_turn and sandbox sections: their checks, and the rollout window they imply."""
import functools

import pytest

from verl_hpc.config import ConfigError, load_config
from verl_hpc.config.validate import validate
from verl_hpc.rollout.engine_config import engine_kwargs
from verl_hpc.trainer.roles import rollout_options

import config_checks

BASE = ["trainer.job=rl", "model.path=/nonexistent", "data.train_files=[x.parquet]", "rollout.n=2",
        "multi_turn.enable=true"]


problems = functools.partial(config_checks.refused, base=BASE)


@pytest.mark.parametrize("overrides, wanted", [
    (["multi_turn.user_tools=[my.tools:search]"], "multi_turn.user_tools runs your own code: set safety.allow_custom_code"),
    (["multi_turn.environment=my.env:Game"], "multi_turn.environment runs your own code"),
    (["multi_turn.user_tools=[nocolon]", "safety.allow_custom_code=true"], "'nocolon' is not 'package.module:name'"),
    (["placement.mode=split", "placement.rollout_ranks=1"], "multi_turn.enable does not run with placement.mode = split"),
    (["algorithm.adv_estimator=remax", "rollout.n=1"], "does not run algorithm.adv_estimator = remax"),
    (["trainer.job=sft", "data.sft_files=[x.parquet]"], "multi_turn.enable is for trainer.job = rl"),
    (["sandbox.wall_time_s=1e9"], "sandbox time limits are capped at one week"),
    # a thread per worker: 1000000 died at start-up on "can't start new thread"
    (["multi_turn.tool_workers=1000000"], "multi_turn.tool_workers: must be in [0, 256], got 1000000"),
])
def test_checks_name_the_field(overrides, wanted):
    found = problems(*overrides)
    assert any(wanted in p for p in found), found


def test_a_tool_outside_the_builtins_is_a_choice_error():
    with pytest.raises(ConfigError, match="multi_turn.tools"):
        validate(load_config(None, [*BASE, "multi_turn.tools=[search]"]), check_model=False)


def test_the_engine_window_spans_the_episode():
    one = load_config(None, ["data.max_response_length=96", "rollout.max_tokens=32"])
    many = load_config(None, ["data.max_response_length=96", "rollout.max_tokens=32", "multi_turn.enable=true"])
    assert engine_kwargs(rollout_options(one), "hf")["max_response_length"] == 32  # one response
    assert engine_kwargs(rollout_options(many), "hf")["max_response_length"] == 96  # later turns: prompt + episode so far


def test_the_default_tool_workers_stay_within_the_cap():
    mt = load_config(None, []).multi_turn
    assert (mt.workers(1), mt.workers(9), mt.workers(4096)) == (1, 8, 256)
