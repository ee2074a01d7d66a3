"""Loss aggregation: hand values, and the same value for any micro-batch / data-parallel split."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_hpc.algorithms import LOSS_AGG_MODES, agg_loss, compute_policy_loss
from alg_options import pg_options


NAN = float("nan")
LOSS = torch.tensor([[1.0, 2.0, NAN], [4.0, 5.0, 6.0]], dtype=torch.float64)  # NaN in padding
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 18 / 5),
        ("seq-mean-token-sum", {}, (3 + 15) / 2),
        ("seq-mean-token-mean", {}, (1.5 + 5) / 2),
        ("seq-mean-token-sum-norm", {}, (3 + 15) / 3 / 2),  # norm_len defaults to padded length 3
        ("seq-mean-token-sum-norm", {"norm_len": 4}, (3 + 15) / 4 / 2),
        ("token-mean", {"global_tokens": 10}, 18 / 10),
        ("seq-mean-token-mean", {"global_seqs": 4}, (1.5 + 5) / 4),
    ],
)
def test_hand_values(mode, kwargs, expected):
    assert agg_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected, abs=1e-12)


def test_gradient_ignores_padding_nan():
    loss = LOSS.clone().requires_grad_(True)
    agg_loss(loss * 2, MASK, "token-mean").backward()
    assert torch.equal(loss.grad, torch.tensor([[0.4, 0.4, 0.0], [0.4, 0.4, 0.4]], dtype=torch.float64))


def test_bad_mode_lists_valid_names():
    with pytest.raises(ValueError, match="actor.loss_agg_mode.*token-mean, seq-mean-token-sum"):
        agg_loss(LOSS, MASK, "mean")


def test_zero_length_and_shape_and_count_errors():
    with pytest.raises(ValueError, match=r"row index\(es\) \[0, 2\]"):
        agg_loss(torch.zeros(3, 2), torch.tensor([[0, 0], [1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"loss_mat has shape \(2, 3\).*response_mask has shape \(2, 2\)"):
        agg_loss(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="global_tokens must be positive"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), global_tokens=0)


def _batch(seed, batch, length):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    loss = torch.randn(batch, length, generator=g, dtype=torch.float64)
    return loss, mask


def _split(batch, cuts):
    """Row slices for the sorted distinct cut points."""
    bounds = [0] + sorted({c for c in cuts if 0 < c < batch}) + [batch]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 9),
    length=st.integers(1, 6),
    cuts=st.lists(st.integers(0, 9), max_size=5),
)
def test_any_split_sums_to_the_full_batch_value(seed, batch, length, cuts):
    loss, mask = _batch(seed, batch, length)
    global_tokens, global_seqs = mask.sum(), batch
    for mode in LOSS_AGG_MODES:
        full = agg_loss(loss, mask, mode, norm_len=length)
        total = torch.zeros((), dtype=torch.float64)
        for rows in _split(batch, cuts):
            mb_loss, mb_mask = loss[rows], mask[rows]
            # each micro-batch may be re-padded to its own longest response
            keep = int(mb_mask.sum(-1).max())
            total = total + agg_loss(
                mb_loss[:, :keep], mb_mask[:, :keep], mode,
                global_tokens=global_tokens, global_seqs=global_seqs, norm_len=length,
            )
        torch.testing.assert_close(total, full, rtol=1e-10, atol=1e-12)


def test_local_mean_of_micro_batches_is_not_the_full_value():
    # Why the global counts exist: averaging per-micro-batch token means is wrong for uneven splits.
    loss, mask = torch.tensor([[1.0, 0.0], [3.0, 5.0]], dtype=torch.float64), torch.tensor([[1, 0], [1, 1]])
    full = agg_loss(loss, mask, "token-mean")
    naive = (agg_loss(loss[:1], mask[:1], "token-mean") + agg_loss(loss[1:], mask[1:], "token-mean")) / 2
    assert full.item() == pytest.approx(3.0) and naive.item() == pytest.approx(2.5)


def test_policy_loss_split_with_global_counts_matches_full_batch():
    g = torch.Generator().manual_seed(0)
    batch, length = 6, 5
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    old = torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.3
    new = (old + 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    for mode in LOSS_AGG_MODES:
        full, _ = compute_policy_loss("vanilla", old, new, adv, mask, **pg_options("vanilla", loss_agg_mode=mode),
                                      norm_len=length)
        (g_full,) = torch.autograd.grad(full, new)
        parts = [
            compute_policy_loss(
                "vanilla", old[s], new[s], adv[s], mask[s], **pg_options("vanilla", loss_agg_mode=mode),
                global_tokens=mask.sum(), global_seqs=batch, norm_len=length,
            )[0]
            for s in (slice(0, 1), slice(1, 4), slice(4, 6))
        ]
        (g_split,) = torch.autograd.grad(sum(parts), new)
        torch.testing.assert_close(sum(parts), full)
        torch.testing.assert_close(g_split, g_full)
