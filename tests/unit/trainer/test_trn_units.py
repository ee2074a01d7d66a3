"""Unit tests of the trainer's pieces that need no engine: batch assembly, guard, shaping."""
import pytest
import torch

from verl_hpc.config import load_config
from verl_hpc.data import PromptBatch
from verl_hpc.rollout import RolloutResult
from verl_hpc.trainer.batching import assemble, logprob_diff_metrics
from verl_hpc.trainer.guard import NonFiniteError, NonFiniteGuard
from verl_hpc.trainer import shaping

pytestmark = pytest.mark.unit


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
    assert b.tensors["input_ids"][1].tolist() == [1, 2, 6, 7]
    m = logprob_diff_metrics(b.rollout_log_probs, b.rollout_log_probs + 0.1 * b.mask, b.mask)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.1)
    kept = b.select(torch.tensor([False, True, False, True]))
    assert kept.ids == ["a", "b"] and kept.tensors["input_ids"].shape[0] == 2


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
    B.mask = mask
    keep, m = shaping.dynamic_sampling_filter(token_scores, B(), cfg)
    assert keep.tolist() == [True, True, False, False] and m["filter/dropped_groups"] == 1
    adv, _ = shaping.advantages(cfg, token_scores, {"response_mask": mask}, B.group_ids)
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2].abs().max() < 1e-4
