"""The scorer kind of reward.reward_model: the FSDP engine's reward role on a
*ForSequenceClassification folder equals transformers' own forward, and its scores combine with
the rules by the configured weights and normalisation."""
import dataclasses

import pytest
import torch

from verl_hpc.rewards.reward_model import combine, normalize, rm_scores


def _batch(vocab: int, gen: torch.Generator):
    prompts, responses = torch.tensor([3, 5, 2, 4]), torch.tensor([4, 2, 5, 1])
    seq = int((prompts + responses).max())
    ids = torch.zeros(4, seq, dtype=torch.long)
    mask = torch.zeros(4, int(responses.max()))
    for i in range(4):
        n = int(prompts[i] + responses[i])
        ids[i, :n] = torch.randint(5, vocab, (n,), generator=gen)
        mask[i, : int(responses[i])] = 1
    return {"input_ids": ids, "prompt_lengths": prompts, "response_lengths": responses, "response_mask": mask}


def test_fsdp_scorer_equals_transformers_sequence_classification(tmp_path, one_rank_world):
    from transformers import AutoModelForSequenceClassification

    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options
    from verl_hpc.engines.roles import wrap_role
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.models.tiny_reward import make_tiny_classifier

    folder = make_tiny_classifier(make_tiny_model(tmp_path / "lm", "llama", layers=2), tmp_path / "rm", seed=7)
    o = default_options(str(folder), engine="fsdp", dtype="float32", head="value", trainable=False, optim=None,
                        lora=None, share_prompts="off", micro_batch_size=3, max_tokens_per_microbatch=0)
    o = dataclasses.replace(o, fsdp=dataclasses.replace(o.fsdp, mixed_precision="fp32"))
    rm = wrap_role("reward", FsdpEngine(o, "reward.reward_model.path"))
    batch = _batch(400, torch.Generator().manual_seed(1))
    got = rm_scores(rm, batch, 4)

    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float64).eval()
    want = []
    with torch.no_grad():
        for i in range(4):  # each row alone: the last token is the last non-pad token
            n = int(batch["prompt_lengths"][i] + batch["response_lengths"][i])
            want.append(float(hf(batch["input_ids"][i: i + 1, :n]).logits[0, 0]))
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-4), (got, want)
    assert float(got.std()) > 1e-3  # a head that reads the sequence, not a constant


def test_combine_weights_and_batch_normalisation():
    rule = torch.tensor([1.0, 0.0, 5.0, 0.0])
    has_rule = torch.tensor([True, True, False, False])
    rm = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    out = combine(rule.double(), has_rule, rm, weight=0.5, rule_weight=2.0)
    assert out.tolist() == [2.0 + 1.0, 0.0 - 0.5, 0.25, 1.5]
    z = normalize(rm, "batch")
    ref = (rm - rm.mean()) / rm.std(unbiased=False)
    assert torch.allclose(z, ref) and abs(float(z.mean())) < 1e-12
    assert normalize(torch.tensor([4.0, 4.0]), "batch").tolist() == [0.0, 0.0]  # no spread: centred only
    assert normalize(rm, "none") is rm


def test_scorer_uses_the_configured_weights():
    from verl_hpc.config import load_config
    from verl_hpc.rewards.scorer import RewardScorer

    class Fixed:
        def score(self, batch):
            return {"rm_scores": torch.tensor([1.0, 3.0]), "rm_token_scores": torch.zeros(2, 1)}

    cfg = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.path=/rm",
                             "reward.reward_model.weight=0.5", "reward.reward_model.rule_weight=2",
                             "reward.reward_model.normalize=batch"])
    scorer = RewardScorer.from_config(cfg.reward, Fixed(), allow_custom_code=False)
    scores, m = scorer.score(["a", "b"], ["gsm8k", "no_rule_source"], ["#### 4", "x"], ["4", ""], rm_batch=None)
    # normalised rm: [-1, 1]; row a: 2 x 1 (right) + 0.5 x -1; row b (no rule): 0.5 x 1
    assert scores.tolist() == pytest.approx([1.5, 0.5])
    assert m["reward/rm/mean"] == 2.0


def test_rules_only_scorer_for_validation():
    """reward.reward_model.validate = false: validation scores by the rule alone."""
    from verl_hpc.config import load_config
    from verl_hpc.rewards.scorer import RewardScorer

    class Never:
        def score(self, batch):
            raise AssertionError("validation asked the reward model")

    cfg = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.path=/rm",
                             "reward.reward_model.rule_weight=0", "reward.reward_model.validate=false"])
    rules = RewardScorer.from_config(cfg.reward, Never(), allow_custom_code=False).rules_only()
    scores, m = rules.score(["a", "b"], ["gsm8k", "gsm8k"], ["#### 4", "#### 5"], ["4", "4"])
    assert scores.tolist() == [1.0, 0.0] and "reward/rm/mean" not in m  # rule_weight applies to the model mix only
