"""multi_turn.environment: each defect of a user environment is one line naming it ('module:Class'),
the method and what is valid: a ConfigError for the code's defects (at load: a class that cannot be
built with no arguments or called as reset(row) / step(turn_text); when episodes start: __init__ or
reset raising; a step that returns something else than a triple), a counted observation for a
step that raises (SystemExit and its own KeyboardInterrupt too), and reward.on_error for a reward
that is not a finite number. A real Ctrl-C during a step still stops the job."""
import pytest

from verl_hpc.config import load_config
from verl_hpc.config.errors import ConfigError
from verl_hpc.rewards.errors import RewardError
from verl_hpc.rollout.episodes.build import build_responder
from verl_hpc.rollout.episodes.runner import Turn
from verl_hpc.trainer.roles import episode_options

SPEC = "user_tools_example:{}"  # tests/unit/rollout/user_tools_example.py


def responder(name, on_error="zero"):
    return build_responder(episode_options(load_config(None, [
        "multi_turn.enable=true", f"multi_turn.environment={SPEC.format(name)}", "safety.allow_custom_code=true",
        f"reward.on_error={on_error}"])))


@pytest.mark.parametrize("name, wanted", [
    ("NeedsSize", "'user_tools_example:NeedsSize': cannot be called as NeedsSize() (missing a required argument: "
                  "'size'); it is built with no arguments, one instance per episode"),
    ("StepTakesNothing", "'user_tools_example:StepTakesNothing': cannot be called as step(turn_text) (too many "
                         "positional arguments); each model turn is handed over so"),
])
def test_a_class_the_episodes_cannot_call_is_refused_at_load(name, wanted):
    with pytest.raises(ConfigError) as e:
        responder(name)
    assert str(e.value) == f"multi_turn.environment = {wanted}"


@pytest.mark.parametrize("name, row, wanted", [
    ("BuiltBadly", {}, "__init__() raised RuntimeError: no licence server (row {}); it is built with no arguments"),
    ("Behaves", {"reset": "raise"}, "reset(row) raised KeyError: 'target' (row {'reset': 'raise'}); the episode "
                                    "cannot start without it"),
    ("Behaves", {"reset": "exit"}, "reset(row) raised SystemExit: 0 (row {'reset': 'exit'})"),
])
def test_a_failure_as_episodes_start_ends_the_job_naming_the_method(name, row, wanted):
    env = responder(name)
    with pytest.raises(ConfigError) as e:
        env.start([{}, row])
    assert str(e.value).startswith(f"multi_turn.environment = '{SPEC.format(name)}': {wanted}"), str(e.value)


def step(env, *texts):
    env.start([{} for _ in texts])
    return env.respond([Turn(k, text, ()) for k, text in enumerate(texts)])


def test_a_step_that_raises_is_an_observation_and_a_counted_error():
    """SystemExit(0) ended the rank with exit code 0, and the environment's own KeyboardInterrupt
    with a traceback: both are the step's failure, like any exception."""
    ok, raised, exited, interrupted = step(responder("Behaves"), "reward half", "raise", "exit", "interrupt")
    assert (ok.observations, ok.reward, ok.errors, ok.done) == (["go on"], 0.5, 0, False)
    assert raised.observations == ["error: ValueError: cannot read the turn"]
    assert exited.observations == ["error: SystemExit: 0"]
    assert interrupted.observations == ["error: KeyboardInterrupt"]
    assert all(r.errors == 1 and not r.done and r.reward == 0.0 for r in (raised, exited, interrupted))


def test_a_step_that_does_not_return_a_triple_ends_the_job():
    with pytest.raises(ConfigError, match=r"^multi_turn.environment = 'user_tools_example:Behaves': step\(turn_text\) "
                                          r"returned \('only two', 1.0\); expected \(observation: str or None"):
        step(responder("Behaves"), "shape")


BAD_REWARDS = {"text": "reward 'high' (a str)", "nan": "reward nan", "inf": "reward inf", "true": "reward True (a bool)",
               "huge": "reward 1000000"}


def test_a_reward_that_is_not_a_finite_number_follows_reward_on_error():
    replies = step(responder("Behaves"), *(f"reward {k}" for k in BAD_REWARDS), "reward none")
    *bad, none = replies
    assert all(r.reward == 0.0 and r.errors == 1 and r.observations == ["go on"] for r in bad)
    assert none.reward == 0.0 and none.errors == 0  # None: no term
    for key, wanted in BAD_REWARDS.items():
        with pytest.raises(RewardError) as e:
            step(responder("Behaves", on_error="raise"), f"reward {key}")
        assert str(e.value).startswith(f"multi_turn.environment = 'user_tools_example:Behaves': step(turn_text) "
                                       f"returned {wanted}"), str(e.value)
        # the wording of a reward function's bad score (rewards/scorer.py score_problem)
        assert ("expected a finite number" in str(e.value) or "return a number" in str(e.value)) \
            and "reward.on_error=zero" in str(e.value)


def test_a_real_ctrl_c_during_a_step_still_stops(terminal_sigint):
    with pytest.raises(KeyboardInterrupt):
        step(responder("Behaves"), "ctrl-c")
