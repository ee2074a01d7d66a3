"""DAPO dynamic-sampling filter and overlong reward shaping."""
import numpy as np
import pytest
import torch

from verl_hpc.algorithms import apply_overlong_penalty, filter_groups, overlong_penalty
from alg_options import OVERLONG


SCORES = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
IDS = ["a", "a", "b", "b", "c", "d", "d", "d"]  # a all equal, b mixed, c singleton, d all equal


def test_filter_groups_drops_all_equal_groups_and_reports_counts():
    keep, m = filter_groups(SCORES, IDS)
    assert keep.tolist() == [False, False, True, True, True, False, False, False]
    assert m == {"kept_groups": 2, "dropped_groups": 2, "kept_samples": 3, "dropped_samples": 5}


def test_filter_groups_singletons_optional_and_id_kinds():
    keep, m = filter_groups(SCORES, np.array(IDS), keep_singletons=False)
    assert keep.tolist() == [False, False, True, True, False, False, False, False]
    assert m["kept_groups"] == 1 and m["dropped_samples"] == 6
    keep_t, _ = filter_groups(SCORES, torch.tensor([5, 5, 2, 2, 9, 0, 0, 0]))
    assert keep_t.tolist() == filter_groups(SCORES, IDS)[0].tolist()


def test_filter_groups_all_equal_batch_keeps_nothing():
    keep, m = filter_groups(torch.ones(4), [0, 0, 1, 1])
    assert not keep.any() and m["kept_groups"] == 0 and m["dropped_groups"] == 2


def test_filter_groups_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"seq_scores must be 1-D"):
        filter_groups(torch.ones(2, 3), [0, 1])
    with pytest.raises(ValueError, match="group_ids has length 3 but the batch has 4 rows"):
        filter_groups(torch.ones(4), [0, 0, 1])


def test_overlong_penalty_linear_ramp():
    # max 10, buffer 4: free up to 6, then -1/4 per token, -1 at 10 and beyond
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    got = overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    got = overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


def test_apply_overlong_penalty_lands_on_the_last_valid_token():
    lengths = [2, 5, 4]
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    scores = torch.zeros(3, 5, dtype=torch.float64)
    scores[0, 1], scores[1, 4], scores[2, 3] = 1.0, 1.0, 0.0
    out, m = apply_overlong_penalty(scores, mask, max_len=5, buffer_len=2, penalty_factor=1.0)
    # free up to 3: lengths 2 -> 0, 5 -> -1, 4 -> -0.5
    expected = scores.clone()
    expected[1, 4] -= 1.0
    expected[2, 3] -= 0.5
    torch.testing.assert_close(out, expected)
    assert m["overlong_frac"].item() == pytest.approx(2 / 3)
    assert m["overlong_penalty_mean"].item() == pytest.approx(-0.5)
    assert torch.equal(scores[0], out[0]) and lengths == mask.sum(-1).tolist()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_len=10, buffer_len=0), "overlong_buffer.len"),
        (dict(max_len=10, buffer_len=11), "overlong_buffer.len"),
        (dict(max_len=10, buffer_len=4, penalty_factor=-1.0), "penalty_factor"),
    ],
)
def test_overlong_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([3]), **{"penalty_factor": OVERLONG.penalty_factor, **kwargs})


def test_apply_overlong_penalty_rejects_zero_length():
    with pytest.raises(ValueError, match=r"row index\(es\) \[1\]"):
        apply_overlong_penalty(torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]), 3, 1, OVERLONG.penalty_factor)
