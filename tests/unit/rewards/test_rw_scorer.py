"""RewardScorer: routing, custom functions behind allow_custom_code, on_error, token level, reward model."""
import logging
import textwrap

import pytest
import torch

from verl_hpc.config import JobConfig
from verl_hpc.config.schema import RewardConfig, RewardModelConfig, choices_of
from verl_hpc.rewards import RewardError, RewardScorer, known_names, resolve
from verl_hpc.rewards.custom import load_custom_function
from verl_hpc.rewards.gsm8k import METHODS
from verl_hpc.rewards.scorer import ON_ERROR

REWARD, SAFETY = JobConfig().reward, JobConfig().safety


def scorer_with(**kw):
    """A RewardScorer with the default reward section's on_error and gsm8k_method, `kw` on top."""
    return RewardScorer(**dict(dict(on_error=REWARD.on_error, gsm8k_method=REWARD.gsm8k_method), **kw))


@pytest.mark.parametrize("source,name", [
    ("gsm8k", "gsm8k"), ("openai/gsm8k", "gsm8k"), ("GSM8K-test", "gsm8k"), ("gsm8k_flexible", "gsm8k_flexible"),
    ("math", "math"), ("lighteval/MATH", "math"), ("HuggingFaceH4/MATH-500", "math"),
    ("DigitalLearningGmbH/MATH-lighteval", "math"), ("competition_math", "math"),
    ("synthetic_arith", "synthetic_arith"), ("exact_match", "exact_match"),
    ("visual", "visual"), ("visual_count", "visual"), ("visual_colour", "visual"), ("visual_bar", "visual"),
])
def test_routing_by_name_alias_and_prefix(source, name):
    assert resolve(source).name == name


def test_unknown_source_is_a_clear_error():
    assert resolve("mathematics") is None  # a prefix needs a separator after it
    with pytest.raises(RewardError) as e:
        scorer_with().score(["f.jsonl:3"], ["gsm8kk"], ["#### 1"], ["1"])
    msg = str(e.value)
    assert "sample f.jsonl:3" in msg and "'gsm8kk'" in msg and "did you mean 'gsm8k'" in msg
    assert all(n in msg for n in known_names()) and "safety.allow_custom_code=true" in msg


def test_scores_and_metrics_per_data_source():
    scorer = scorer_with()
    scores, metrics = scorer.score(
        ids=["a:0", "a:1", "b:0", "c:0"], data_sources=["openai/gsm8k", "openai/gsm8k", "math", "synthetic_arith"],
        response_texts=["so #### 72", "#### 71", "$\\boxed{\\frac12}$", "7"], ground_truths=["72", "72", "0.5", "7"])
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert metrics["reward/score/openai/gsm8k"] == 0.5 and metrics["reward/score/math"] == 1.0
    assert metrics["reward/score/mean"] == 0.75 and metrics["reward/errors"] == 0.0
    flexible = scorer_with(gsm8k_method="flexible")
    assert flexible.score(["a:0"], ["gsm8k"], ["it is 72"], ["72"])[0].tolist() == [1.0]


def test_check_samples_refuses_bad_data_before_training():
    scorer = scorer_with()
    scorer.check_samples(["a:0", "b:0"], ["gsm8k", "synthetic_arith"], ["1,200", "7"])
    with pytest.raises(RewardError) as e:
        scorer.check_samples(["a:0", "a:1", "b:0", "c:5"], ["gsm8k", "gsm8k", "synthetic_arith", "mbpp"],
                             ["72", "seventy", "1.5", "x"])
    msg = str(e.value)
    assert msg.startswith("3 problems")
    assert "sample a:1 (data_source 'gsm8k'): field ground_truth 'seventy' is not a number" in msg
    assert "sample b:0 (data_source 'synthetic_arith'): field ground_truth '1.5' is not an integer" in msg
    assert "sample c:5 (and every other with this source): no reward function for data_source 'mbpp'" in msg


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        from verl_hpc.rewards import default_score

        def length_bonus(data_source, solution_str, ground_truth, extra):
            if data_source == "poetry":
                return {"score": len(solution_str) / 10, "length": len(solution_str)}
            return default_score(data_source, solution_str, ground_truth, extra)

        def flaky(data_source, solution_str, ground_truth, extra):
            if solution_str == "boom":
                raise ZeroDivisionError("division by zero in user code")
            return 1.0

        def not_a_number(data_source, solution_str, ground_truth, extra):
            return float("nan") if solution_str == "nan" else "high"

        def numpy_score(data_source, solution_str, ground_truth, extra):
            import numpy as np
            return {"score": np.float32(0.5), "n": np.int64(3)}

        def two_args(a, b):
            return 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_custom_function_allowed(user_module):
    cfg = RewardConfig(custom_function=f"{user_module}:length_bonus")
    scorer = RewardScorer.from_config(cfg, allow_custom_code=True)
    scores, metrics = scorer.score(["p:0", "g:0"], ["poetry", "gsm8k"], ["roses are red", "#### 3"], ["", "3"],
                                   [{"style": "haiku"}, {}])
    assert scores.tolist() == pytest.approx([1.3, 1.0])
    assert metrics["reward/extra/length"] == 13.0
    scorer.check_samples(["p:0"], ["poetry"], [""])  # the user's function decides what it accepts


def test_custom_function_refused_or_misnamed(user_module):
    with pytest.raises(RewardError, match="set safety.allow_custom_code=true"):
        RewardScorer.from_config(RewardConfig(custom_function=f"{user_module}:length_bonus"), allow_custom_code=False)
    cases = [("no_colon", "expected 'package.module:function'"),
             ("nowhere_module:f", "cannot import module 'nowhere_module'"),
             (f"{user_module}:missing", "has no function 'missing'; callables there: default_score, flaky, "),
             (f"{user_module}:two_args", "cannot be called as fn(data_source, solution_str, ground_truth, extra)")]
    for spec, message in cases:
        with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
            RewardScorer.from_config(RewardConfig(custom_function=spec), allow_custom_code=True)


def test_on_error_zero_counts_and_reports_the_first_traceback(user_module, caplog):
    scorer = RewardScorer.from_config(RewardConfig(custom_function=f"{user_module}:flaky"), allow_custom_code=True)
    with caplog.at_level(logging.ERROR, logger="verl_hpc.rewards.scorer"):
        scores, metrics = scorer.score(["s:0", "s:1", "s:2"], ["x"] * 3, ["ok", "boom", "boom"], ["1"] * 3)
        scores2, metrics2 = scorer.score(["s:3"], ["x"], ["boom"], ["1"])
    assert scores.tolist() == [1.0, 0.0, 0.0] and scores2.tolist() == [0.0]
    assert metrics["reward/errors"] == 2 and metrics2["reward/errors"] == 1 and metrics2["reward/errors_total"] == 3
    assert scorer.first_error.startswith("sample s:1 (data_source 'x'):")
    assert "ZeroDivisionError: division by zero in user code" in scorer.first_error
    assert len([r for r in caplog.records if "reward function failed" in r.message]) == 1  # logged once


def test_on_error_raise_names_the_sample_and_chains(user_module):
    cfg = RewardConfig(custom_function=f"{user_module}:flaky", on_error="raise")
    scorer = RewardScorer.from_config(cfg, allow_custom_code=True)
    with pytest.raises(RewardError) as e:
        scorer.score(["s:0", "train.jsonl:17"], ["poetry", "poetry"], ["ok", "boom"], ["1", "1"])
    assert "sample train.jsonl:17 (data_source 'poetry')" in str(e.value) and "ZeroDivisionError" in str(e.value)
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_non_numeric_returns_follow_on_error(user_module):
    scorer = RewardScorer.from_config(RewardConfig(custom_function=f"{user_module}:not_a_number"),
                                      allow_custom_code=True)
    scores, metrics = scorer.score(["s:0", "s:1"], ["x", "x"], ["nan", "str"], ["1", "1"])
    assert scores.tolist() == [0.0, 0.0] and metrics["reward/errors"] == 2
    assert "expected a finite number" in scorer.first_error
    np_scorer = scorer_with(custom_function=load_custom_function(f"{user_module}:numpy_score",
                                                                  allow_custom_code=True))
    scores, metrics = np_scorer.score(["s:0"], ["x"], ["a"], ["1"])
    assert scores.tolist() == [0.5] and metrics["reward/extra/n"] == 3.0 and metrics["reward/errors"] == 0
    with pytest.raises(RewardError, match="on_error: invalid value 'ignore'; valid: zero, raise"):
        scorer_with(on_error="ignore")



def test_on_error_and_gsm8k_methods_are_the_config_choices():
    assert set(choices_of("reward.on_error")) == set(ON_ERROR)
    assert set(choices_of("reward.gsm8k_method")) == set(METHODS)


def test_to_token_level_puts_the_score_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = RewardScorer.to_token_level(torch.tensor([0.5, 1.0, -1.0, 2.0]), mask)
    assert out.tolist() == [[0, 0, 0.5, 0], [1.0, 0, 0, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]
    with pytest.raises(RewardError, match="must be"):
        RewardScorer.to_token_level(torch.ones(3), mask)


class FakeRewardModel:
    """Stands in for the engine's reward role: one score per response, from the batch it is handed."""

    def __init__(self, values):
        self.values, self.seen = values, None

    def score(self, batch):
        self.seen = batch
        return torch.tensor(self.values)


def test_reward_model_adds_to_rules_and_scores_sources_without_one():
    rm = FakeRewardModel([0.25, 0.5, 0.75])
    cfg = RewardConfig(reward_model=RewardModelConfig(enable=True, path="rm"))
    scorer = RewardScorer.from_config(cfg, reward_model=rm, allow_custom_code=SAFETY.allow_custom_code)
    scores, metrics = scorer.score(["a:0", "a:1", "c:0"], ["gsm8k", "gsm8k", "chitchat"],
                                   ["#### 1", "#### 2", "hello"], ["1", "1", ""], rm_batch="the rollout batch")
    assert rm.seen == "the rollout batch"
    assert scores.tolist() == [1.25, 0.5, 0.75]  # rule + rm where a rule exists, rm alone elsewhere
    assert metrics["reward/rm/mean"] == pytest.approx(0.5) and metrics["reward/rule/mean"] == 0.5
    scorer.check_samples(["c:0"], ["chitchat"], [""])  # no rule needed when a reward model scores it
    with pytest.raises(RewardError, match="returned 2 scores for a batch of 3"):
        scorer_with(reward_model=FakeRewardModel([1.0, 2.0])).score(["a", "b", "c"], ["x"] * 3, [""] * 3,
                                                                     [""] * 3)
    with pytest.raises(RewardError, match="no reward model was passed"):
        RewardScorer.from_config(RewardConfig(reward_model=RewardModelConfig(enable=True, path="rm")),
                                 allow_custom_code=SAFETY.allow_custom_code)


def test_score_components_for_gdpo():
    """score_with_components: each key's number from the returned dicts ('score': the score itself);
    a failed call (on_error zero) gives 0s, a dict without the key is an error naming key and sample."""
    def two_parts(data_source, text, truth, extra):
        if text == "boom":
            raise RuntimeError("boom")
        if text == "plain":
            return {"score": 0.5}
        return {"score": float(text == truth), "fmt": 1.0 if text.startswith("#") else 0.0}

    scorer = scorer_with(custom_function=two_parts)
    scores, comps, metrics = scorer.score_with_components(
        ["a:0", "a:1", "a:2"], ["x"] * 3, ["#3", "4", "boom"], ["#3", "3", "3"], keys=["fmt", "score"])
    assert scores.tolist() == [1.0, 0.0, 0.0] and comps.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert metrics["reward/errors"] == 1 and metrics["reward/extra/fmt"] == 0.5
    assert scorer.score(["a:0"], ["x"], ["#3"], ["#3"])[0].tolist() == [1.0]  # score() unchanged
    with pytest.raises(RewardError, match=r"returned no number under 'fmt' for sample b:1 \(data_source 'x'\)"):
        scorer.score_with_components(["b:0", "b:1"], ["x"] * 2, ["#3", "plain"], ["#3", "3"], keys=["fmt"])
