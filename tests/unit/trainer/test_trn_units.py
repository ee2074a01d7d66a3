"""Unit tests of the trainer's pieces that need no engine: batch assembly, guard, the DAPO
filter and the advantage stage."""
import pytest
import torch

from verl_hpc.config import load_config
from verl_hpc.data import PromptBatch
from verl_hpc.rollout import RolloutResult
from verl_hpc.trainer.stages.advantage import advantages
from verl_hpc.trainer.stages.batching import assemble, logprob_diff_metrics
from verl_hpc.trainer.hooks.guard import NonFiniteError, NonFiniteGuard
from verl_hpc.trainer.stages.sampling import group_filters
from verl_hpc.trainer.stages.step_batch import concat_batches, first_groups


class Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in ids]


def test_trn_assemble_repeats_prompt_fields_and_masks():
    prompts = PromptBatch(ids=["a", "b"], prompt_ids=[[1, 2], [3]], prompt_texts=["x", "y"],
                          data_sources=["s", "t"], ground_truths=["1", "2"], extras=[{}, {}])
    res = RolloutResult(prompts=[[1, 2], [3]], prompt_index=[0, 0, 1, 1], sample_index=[0, 1, 0, 1],
                        response_ids=[[5], [6, 7], [], [8, 9]], logprobs=[[-1.0], [-1.0, -2.0], [], [-.5, -.5]],
                        finish_reason=["stop"] * 4)
    b = assemble(prompts, res, Tok(), pad_id=0)
    assert b.ids == ["a", "a", "b", "b"] and b.ground_truths == ["1", "1", "2", "2"]
    assert b.group_ids.tolist() == [0, 0, 1, 1]
    assert b.mask.tolist() == [[1, 0], [1, 1], [0, 0], [1, 1]]  # the empty reply is masked out
    assert b.input_ids[1].tolist() == [1, 2, 6, 7]
    m = logprob_diff_metrics(b.rollout_log_probs, b.rollout_log_probs + 0.1 * b.mask, b.mask)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.1)
    kept = b.select(torch.tensor([False, True, False, True]))
    assert kept.ids == ["a", "b"] and kept.input_ids.shape[0] == 2


def _round(responses, n=2):
    k = len(responses) // n
    prompts = PromptBatch(ids=[f"p{i}" for i in range(k)], prompt_ids=[[1, 2]] * k,
                          prompt_texts=["x"] * k, data_sources=["s"] * k, ground_truths=["1"] * k,
                          extras=[{}] * k)
    res = RolloutResult(prompts=[[1, 2]] * k, prompt_index=[i // n for i in range(len(responses))],
                        sample_index=[i % n for i in range(len(responses))], response_ids=responses,
                        logprobs=[[-0.5] * len(r) for r in responses],
                        finish_reason=["stop"] * len(responses))
    return assemble(prompts, res, Tok(), pad_id=0)


def test_trn_dapo_refill_concatenates_rounds():
    a = _round([[5], [6], [7], [8]]).select(torch.tensor([False, False, True, True]))  # group 1 kept
    b = _round([[5, 6, 7], [6], [7, 8], [9]])
    a.token_scores, b.token_scores = torch.ones(2, 1), torch.full((4, 3), 2.0)
    batch = concat_batches([a, b], pad_id=0)
    scores = batch.token_scores
    assert len(batch) == 6 and batch.ids == ["p1", "p1", "p0", "p0", "p1", "p1"]
    assert batch.group_ids.tolist() == [1, 1, 2, 2, 3, 3]  # distinct across rounds
    assert batch.mask.tolist()[0] == [1, 0, 0] and batch.mask.tolist()[2] == [1, 1, 1]
    assert batch.input_ids[0].tolist() == [1, 2, 7, 0, 0]  # padded with pad_id
    assert scores.shape == (6, 3) and scores[0].tolist() == [1, 0, 0]
    assert batch.rollout_log_probs.shape == (6, 3)
    assert batch.response_lengths.tolist() == [1, 1, 3, 1, 2, 1]
    assert batch.baselines is None  # a field no round filled stays unfilled
    keep = first_groups(batch, 2)
    assert keep.tolist() == [True, True, True, True, False, False]


def test_trn_guard_counts_and_stops():
    g = NonFiniteGuard(2)
    assert g.check({"actor/nonfinite_steps": 1.0}, 1)["train/nonfinite_in_a_row"] == 1
    assert g.check({"actor/nonfinite_steps": 0.0}, 2)["train/nonfinite_in_a_row"] == 0
    g.check({"actor/nonfinite_steps": 1.0}, 3)
    with pytest.raises(NonFiniteError, match="2 steps in a row.*max_nonfinite_in_a_row=2"):
        g.check({"critic/nonfinite_steps": 2.0}, 4)
    assert g.total == 3


def test_trn_grpo_advantages_and_filter():
    cfg = load_config(None, ["algorithm.recipe=dapo", "algorithm.overlong_buffer.enable=false"])
    mask = torch.ones(4, 2)
    token_scores = torch.tensor([[0, 1.], [0, 0], [0, 1], [0, 1]])

    class B:
        group_ids = torch.tensor([0, 0, 1, 1])
        def __len__(self):
            return 4
    B.mask, B.token_scores = mask, token_scores
    keep, m = group_filters(B(), cfg.algorithm)
    assert keep.tolist() == [True, True, False, False] and m["filter/dropped_groups"] == 1
    adv, _ = advantages(cfg.algorithm, token_scores, mask, B.group_ids)
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2].abs().max() < 1e-4
