"""A run's recorded calls -> training sequences: merged token for token, split otherwise."""
import pytest

from verl_hpc.rollout.agents.trajectory import Call, merge_calls


def call(prompt, completion, order, finish="stop"):
    return Call(list(prompt), list(completion), [-0.5 - k for k in range(len(completion))], finish, order)


def test_a_call_that_extends_the_previous_one_is_merged_with_its_new_prompt_tokens_unmasked():
    first = call([1, 2, 3], [10, 11], 1)
    second = call([1, 2, 3, 10, 11, 7, 8], [12], 2)  # the agent added a tool result (7, 8)
    [t], merges, splits = merge_calls([second, first])  # out of order: arrival order decides
    assert (merges, splits) == (1, 0)
    assert t.ids() == [1, 2, 3, 10, 11, 7, 8, 12]
    assert t.prompt == [1, 2, 3]
    assert t.mask == [1, 1, 0, 0, 1]
    assert t.logprobs == [-0.5, -1.5, 0.0, 0.0, -0.5]
    assert t.calls == 2


def test_a_rewritten_history_starts_a_sequence_of_its_own():
    first = call([1, 2, 3], [10, 11], 1)
    truncated = call([1, 2, 3, 10, 7], [12], 2)  # the agent dropped token 11 (re-templated its reply)
    third = call([1, 2, 3, 10, 7, 12, 9], [13], 3)  # extends the second, not the first
    ts, merges, splits = merge_calls([first, truncated, third])
    assert (merges, splits) == (1, 1)
    assert [t.ids() for t in ts] == [[1, 2, 3, 10, 11], [1, 2, 3, 10, 7, 12, 9, 13]]
    assert ts[1].mask == [1, 0, 1]


def test_a_call_extends_the_most_recent_sequence_it_begins_with():
    a = call([1], [2], 1)
    b = call([5], [6], 2)
    c = call([1, 2, 3], [4], 3)
    ts, merges, splits = merge_calls([a, b, c])
    assert (merges, splits) == (1, 1)
    assert [t.ids() for t in ts] == [[1, 2, 3, 4], [5, 6]]


def test_logprobs_must_match_the_sampled_tokens():
    with pytest.raises(ValueError, match="1 log-probs for 2 sampled tokens"):
        merge_calls([Call([1], [2, 3], [-1.0], "stop", 1)])
