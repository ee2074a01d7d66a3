"""Pre-queue checks of reward.reward_model.path (validate with the folders read): one line each."""
import pytest

from verl_hpc.config import load_config, validate
from verl_hpc.config.errors import ConfigError


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.models.tiny_reward import make_tiny_classifier

    root = tmp_path_factory.mktemp("rm")
    lm = make_tiny_model(root / "lm", "llama", layers=1)
    other = make_tiny_model(root / "other", "llama", layers=1, vocab_size=300)
    return {"lm": lm, "rm": make_tiny_classifier(lm, root / "rm"),
            "rm_other_tok": make_tiny_classifier(other, root / "rm_other")}


def _problems(folders, *overrides):
    cfg = load_config(None, [f"model.path={folders['lm']}", "reward.reward_model.enable=true", *overrides])
    try:
        validate(cfg)
    except ConfigError as e:
        return [p for p in e.problems if p.startswith("reward.reward_model")]
    return []


def test_a_classification_folder_sharing_the_tokenizer_passes(folders):
    assert _problems(folders, f"reward.reward_model.path={folders['rm']}") == []


def test_a_causal_lm_is_not_a_scorer(folders):
    (line,) = _problems(folders, f"reward.reward_model.path={folders['lm']}")
    assert "LlamaForCausalLM, not a sequence-classification model" in line and "\n" not in line


def test_a_scorer_with_another_tokenizer_is_refused(folders):
    (line,) = _problems(folders, f"reward.reward_model.path={folders['rm_other_tok']}")
    assert "is not the policy's" in line and "vocabularies differ" in line


def test_a_missing_judge_folder_and_a_multi_token_yes(folders, tmp_path):
    (line,) = _problems(folders, "reward.reward_model.kind=judge", f"reward.reward_model.path={tmp_path / 'gone'}")
    assert line == f"reward.reward_model.path: no such folder '{tmp_path / 'gone'}'"
    lines = _problems(folders, "reward.reward_model.kind=judge", f"reward.reward_model.path={folders['lm']}",
                      "reward.reward_model.judge.yes_token=definitely correct beyond doubt")
    assert any(line.startswith("reward.reward_model.judge.yes_token = ") and " tokens for the judge" in line
               and "pick a text that is one token" in line for line in lines)
