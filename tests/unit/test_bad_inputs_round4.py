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


# ------------------------------------------------------------------ items 5 and 13: a scorer without its head
@pytest.fixture(scope="module")
def rm_folders(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.models.tiny_reward import make_tiny_classifier

    root = tmp_path_factory.mktemp("rm67")
    lm = make_tiny_model(root / "lm", "llama", layers=1)
    rm = make_tiny_classifier(lm, root / "rm")
    headless = make_tiny_classifier(lm, root / "headless")
    state = load_file(str(headless / "model.safetensors"))
    del state["score.weight"]
    save_file(state, str(headless / "model.safetensors"), metadata={"format": "pt"})
    return dict(lm=lm, rm=rm, headless=headless)


def test_a_scorer_folder_without_score_weight_is_refused_before_the_queue(rm_folders):
    def reward_problems(folder):
        cfg = load_config(None, [f"model.path={rm_folders['lm']}", "reward.reward_model.enable=true",
                                 f"reward.reward_model.path={folder}"])
        with pytest.raises(ConfigError) as e:  # the config has other problems (no data): only this field's count
            validate(cfg)
        return [p for p in e.value.problems if p.startswith("reward.reward_model.path")]

    (line,) = reward_problems(rm_folders["headless"])
    assert one_line(line).startswith(f"reward.reward_model.path: '{rm_folders['headless']}' stores no score.weight")
    assert reward_problems(rm_folders["rm"]) == []  # the same folder with its head passes


def test_the_reward_role_refuses_a_headless_scorer_where_the_dry_run_was_skipped(rm_folders):
    from verl_hpc.trainer.roles import build_reward_model

    cfg = load_config(None, [f"model.path={rm_folders['lm']}", "reward.reward_model.enable=true",
                             f"reward.reward_model.path={rm_folders['headless']}"])
    with pytest.raises(ConfigError, match="stores no score.weight"):
        build_reward_model(cfg, ctx=None, tokenizer=None)  # refused before any engine is built


# ------------------------------------------------------------------ item 9: the judge's template and folder
JUDGE = ["reward.reward_model.enable=true", "reward.reward_model.kind=judge", "reward.reward_model.path=/judge"]


@pytest.mark.parametrize("placeholder, code", [("{response:d}", "d"), ("{question:.3f}", "f")])
def test_a_judge_template_placeholder_with_a_number_format_is_refused(placeholder, code):
    name = placeholder[1:].split(":")[0]
    text = problems(GDPO[:3] + JUDGE + [f"reward.reward_model.judge.template='Q {{question}} R {{response}} {placeholder}'"])
    assert one_line(text).startswith(f"reward.reward_model.judge.template: placeholder {placeholder} does not format "
                                     f"a text (Unknown format code '{code}' for object of type 'str')"), text
    assert f"write {{{name}}}" in text


def test_a_judge_template_with_text_formats_is_accepted():
    from verl_hpc.config.sections.reward import template_problems

    assert template_problems("Q {question!s} R {response:>20} {reference}") == []


def test_a_vision_language_folder_as_judge_is_refused_before_the_queue(tmp_path_factory):
    from verl_hpc.config.rm_folder import judge_folder_problems
    from verl_hpc.models.tiny_vlm import make_tiny_vlm

    vlm = make_tiny_vlm(tmp_path_factory.mktemp("judge_vlm") / "vlm", "qwen2_5_vl")
    (line,) = judge_folder_problems(str(vlm), load_config(None, JUDGE).reward.reward_model.judge)
    assert one_line(line).startswith(f"reward.reward_model.path: '{vlm}' is a vision-language model "
                                     "(Qwen2_5_VLForConditionalGeneration); reward.reward_model.kind = judge reads text")


def test_the_judges_engine_is_closed_when_the_job_fails(monkeypatch):
    """A vLLM judge left open is shut down by vLLM's exit-time finalizer after the job dropped its
    process group, which printed a traceback after the `error:` line: the RL program closes the judge
    (with the rollout engine) on every way out, here a trainer that fails to start."""
    import types

    from verl_hpc.rewards.judge import Judge
    from verl_hpc.trainer.programs import rl

    closed = []
    engine = types.SimpleNamespace(close=lambda: closed.append("engine"))
    judge = Judge(engine, load_config(None, JUDGE).reward.reward_model.judge, on_error="zero")
    roles = types.SimpleNamespace(rollout=None, episodes=None, agents=None, reward_model=judge)
    monkeypatch.setattr(rl, "build_roles", lambda cfg, ctx, with_rollout=True: roles)

    def failing_trainer(*args, **kwargs):
        raise RewardError("the judge failed on 8 of 8 responses")

    monkeypatch.setattr(rl, "RLTrainer", failing_trainer)
    with pytest.raises(RewardError):
        rl._train(None, None, types.SimpleNamespace(builds_rollout=True))
    assert closed == ["engine"]


def test_the_gdpo_estimator_itself_refuses_a_non_finite_weight():
    import torch

    from verl_hpc.algorithms.gdpo import gdpo

    rewards, mask = torch.tensor([[1.0], [0.0]]), torch.ones(2, 1)
    with pytest.raises(ConfigError, match=r"algorithm.gdpo_reward_weights: must be finite numbers, got \[nan\]"):
        gdpo(rewards, mask, torch.tensor([0, 0]), True, reward_weights=[float("nan")])
    adv, _ = gdpo(rewards, mask, torch.tensor([0, 0]), True, reward_weights=[1.0])
    assert torch.isfinite(adv).all()
