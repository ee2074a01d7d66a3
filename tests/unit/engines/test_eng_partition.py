"""Data-parallel row split and micro-batch plans (verl_hpc.engines.partition)."""
import random

import pytest

from verl_hpc.engines.partition import (balanced_split, contiguous_split, equalize,
                                                 plan_microbatches, token_budget_microbatches)


def test_contiguous_split_sizes_differ_by_at_most_one():
    assert contiguous_split(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert contiguous_split(2, 4) == [[0], [1], [], []]


def test_balanced_split_balances_tokens_and_counts():
    rng = random.Random(0)
    lengths = [rng.randint(10, 1000) for _ in range(64)]
    bins = balanced_split(lengths, 4)
    assert sorted(i for b in bins for i in b) == list(range(64))
    assert {len(b) for b in bins} == {16}
    loads = [sum(lengths[i] for i in b) for b in bins]
    contiguous = [sum(lengths[i] for i in b) for b in contiguous_split(64, 4)]
    assert max(loads) - min(loads) <= max(lengths)  # LPT bound
    assert max(loads) - min(loads) < max(contiguous) - min(contiguous)


def test_token_budget_counts_padded_tokens():
    lengths = [10, 3, 9, 2, 8, 30]
    mbs = token_budget_microbatches(range(6), lengths, max_tokens=20)
    assert sorted(i for m in mbs for i in m) == list(range(6))
    for m in mbs:  # rows x longest row within the budget, unless one row alone exceeds it
        assert len(m) * max(lengths[i] for i in m) <= 20 or len(m) == 1
    assert [5] in mbs  # the over-long row gets its own micro-batch


def test_equalize_splits_the_largest_then_adds_empty_ones():
    assert equalize([[0, 1, 2, 3], [4]], 3, [1] * 5) == [[0, 1], [2, 3], [4]]
    assert equalize([[0]], 3, [1]) == [[0], [], []]


@pytest.mark.parametrize("kw", [dict(micro_batch_size=3), dict(max_tokens=40)])
def test_plan_covers_every_row_once_with_equal_counts(kw):
    rng = random.Random(1)
    lengths = [rng.randint(2, 30) for _ in range(23)]
    plan = plan_microbatches(lengths, 4, **kw)
    rows = sorted(i for rank in plan for mb in rank for i in mb)
    assert rows == list(range(23))
    assert len({len(rank) for rank in plan}) == 1


def test_plan_gives_ranks_without_rows_an_empty_micro_batch():
    plan = plan_microbatches([5, 6], 4, micro_batch_size=2)
    assert plan == [[[0]], [[1]], [[]], [[]]]


def test_plan_count_rounded_to_a_multiple_for_the_interleaved_schedule():
    plan = plan_microbatches([5] * 6, 1, micro_batch_size=2, multiple_of=2)
    assert len(plan[0]) == 4 and sorted(i for mb in plan[0] for i in mb) == list(range(6))


def test_plan_needs_a_positive_size():
    with pytest.raises(ValueError, match="micro_batch_size or max_tokens_per_microbatch"):
        plan_microbatches([1, 2], 1)


def test_grouped_dynamic_plan_keeps_a_prompts_rows_on_one_rank_and_together():
    import random

    rng = random.Random(3)
    groups = [list(range(g * 8, g * 8 + 8)) for g in range(6)]
    lengths = [rng.randint(10, 40) for _ in range(48)]
    plan = plan_microbatches(lengths, 2, max_tokens=160, groups=groups)
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(48))
    group_of = {i: g for g, rows in enumerate(groups) for i in rows}
    for rank in plan:
        for mb in rank:
            assert len(mb) * max(lengths[i] for i in mb) <= 160 or len(mb) == 1
    ranks_of = {g: {r for r, rank in enumerate(plan) for mb in rank for i in mb if group_of[i] == g}
                for g in range(6)}
    assert all(len(r) == 1 for r in ranks_of.values()), ranks_of
    # rows of a group fill micro-batches one after another: at most 1 + (its rows split) batches
    # hold it, where the length-sorted plan scatters them
    spread = lambda p: sum(len({tuple(mb) for rank in p for mb in rank if any(group_of[i] == g for i in mb)})  # noqa: E731
                           for g in range(6))
    assert spread(plan) < spread(plan_microbatches(lengths, 2, max_tokens=160))
