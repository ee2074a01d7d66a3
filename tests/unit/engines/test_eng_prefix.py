"""Packed prompts (verl_hpc.engines.prefix): the layout against each sample's own sequence,
and when the cost model packs. The model's results on packed rows are checked against transformers
in tests/dist/engines/test_eng_parity.py."""
import types

import pytest
import torch

from verl_hpc.engines.batch import pack_sequences, response_positions
from verl_hpc.engines.prefix import (
    MAX_PACKED_LEN,
    CostModel,
    PromptSharing,
    choose_layout,
    pack_rows,
    prompt_groups,
)
from verl_hpc.engines.megatron.sdpa import segmented_attention

PROMPTS = [[7, 8, 9], [7, 8, 9], [5], [7, 8, 9], [5], [6, 6]]
RESPONSES = [[1, 2], [3], [4, 4, 4], [10, 11, 12, 13], [2], [9]]


def _batch():
    return pack_sequences(PROMPTS, RESPONSES)


def test_groups_are_identical_prompts_in_order_of_first_appearance():
    b = _batch()
    assert prompt_groups(b["input_ids"], b["prompt_lengths"]) == [[0, 1, 3], [2, 4], [5]]
    # a prompt that is a prefix of another is a different prompt
    b = pack_sequences([[7, 8], [7, 8, 9]], [[1], [1]])
    assert prompt_groups(b["input_ids"], b["prompt_lengths"]) == [[0], [1]]


def test_every_response_token_sees_exactly_its_own_sequence():
    """For each sample and response token: the token scored, the tokens visible at the scoring
    position (ids and rotary positions, in order) equal those of the sample's own unpacked
    sequence at its own scoring position."""
    b = _batch()
    groups = prompt_groups(b["input_ids"], b["prompt_lengths"])
    width = int(b["response_lengths"].max())
    packed = pack_rows(b, groups, width, pad_to=4)
    assert packed.input_ids.shape[0] == len(groups) and packed.input_ids.shape[1] % 4 == 0
    own_pos = response_positions(b["prompt_lengths"], width, b["input_ids"].shape[1])
    for i, (prompt, resp) in enumerate(zip(PROMPTS, RESPONSES)):
        seq = prompt + resp
        row = int(packed.sample_rows[i])
        visible = ~packed.dense_mask()[row, 0]
        for t in range(len(resp)):
            q = int(packed.positions[i, t])
            q_own = int(own_pos[i, t])
            keys = visible[q].nonzero().flatten()
            assert packed.input_ids[row, keys].tolist() == seq[:q_own + 1], (i, t)
            assert packed.position_ids[row, keys].tolist() == list(range(q_own + 1)), (i, t)
            # the next token in the packed row's segment is the token being scored
            assert int(packed.position_ids[row, q]) == q_own
        # positions past the response point inside the row (never read, but valid indices)
        assert bool((packed.positions[i, len(resp):] < packed.input_ids.shape[1]).all())


def test_padding_positions_attend_to_something():
    """No all-masked query row: SDPA would return NaN there."""
    b = _batch()
    packed = pack_rows(b, prompt_groups(b["input_ids"], b["prompt_lengths"]), 4, pad_to=16)
    assert bool((~packed.dense_mask()).any(-1).all())
    assert bool(packed.attention.allowed.any(-1).all())


@pytest.mark.parametrize("pad_to", [1, 4])
def test_segmented_attention_equals_the_dense_mask(pad_to):
    """The two-call attention of packed rows against one SDPA call with the dense mask (GQA,
    float64): outputs at every real position and the gradients of q, k and v; padding gets zeros."""
    b = _batch()
    packed = pack_rows(b, prompt_groups(b["input_ids"], b["prompt_lengths"]), 4, pad_to=pad_to)
    g, s = packed.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, g, heads, 8, dtype=torch.float64, generator=gen).requires_grad_()
               for heads in (4, 2, 2))
    out = segmented_attention(q, k, v, packed.attention, 0.3, gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=~packed.dense_mask(), scale=0.3,
        enable_gqa=True).permute(2, 0, 1, 3)
    real = (packed.segment >= 0).t()
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=1e-12)
    assert float(out.detach()[~real].abs().sum()) == 0.0
    weight = torch.randn(out.shape, dtype=torch.float64, generator=gen) * real[..., None, None]
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-12)


COST = CostModel(pair_weight=0.001)  # about the 102M benchmark model's


def test_cost_model_packs_short_grpo_groups_not_long_responses_or_singletons():
    groups = [list(range(8)), list(range(8, 16))]
    plens, short, long = [40] * 16, [24] * 16, [300] * 16
    assert choose_layout(groups, plens, short, COST)
    assert not choose_layout(groups, plens, long, COST)  # S^2 attention outweighs the saved prompt
    singles = [[i] for i in range(16)]
    assert not choose_layout(singles, plens, short, COST)
    assert not choose_layout(singles, plens, short, COST, force=True)
    # force packs what the cost model declines, but never past MAX_PACKED_LEN
    assert choose_layout(groups, plens, long, COST, force=True)
    too_long = [MAX_PACKED_LEN // 8] * 16
    assert not choose_layout(groups, plens, too_long, COST, force=True)


def test_packed_rows_never_hold_more_padded_tokens_than_plain_rows():
    """A group of 7 beside a single response: packed, the single row is padded to the group's
    length (2 x 7 x ~r tokens against 8 x (p + r)): over a budget made for the plain layout."""
    groups = [list(range(7)), [7]]
    plens, rlens = [4] * 8, [30] * 8
    assert not choose_layout(groups, plens, rlens, COST, force=True)
    assert choose_layout([list(range(4)), list(range(4, 8))], plens, rlens, COST, force=True)


def test_cost_model_weighs_attention_by_the_model_shape():
    cfg = types.SimpleNamespace(hidden_size=768, kv_channels=64, num_query_groups=4,
                                num_attention_heads=12, gated_linear_unit=True, ffn_hidden_size=2560)
    wide = CostModel.for_config(cfg)
    narrow = CostModel.for_config(types.SimpleNamespace(**dict(vars(cfg), hidden_size=64, kv_channels=16,
                                                                 ffn_hidden_size=128, num_attention_heads=4)))
    assert 0 < wide.pair_weight < narrow.pair_weight
    # the 102M benchmark's shape: 8 x 24-token responses to a 17-token prompt pack
    assert choose_layout([list(range(8))], [17] * 8, [24] * 8, wide)


def test_sharing_returns_none_when_nothing_packs():
    b = pack_sequences([[1, 2], [3, 4]], [[5], [6]])
    assert PromptSharing(COST, force=True)(b, 1) is None
    b = _batch()
    assert PromptSharing(COST, force=True)(b, 4) is not None


@pytest.mark.parametrize("force", [False, True])
def test_sharing_on_a_large_batch_is_fast(force):
    """The per-micro-batch decision runs on every call: keep it far below a forward's cost."""
    import time

    b = pack_sequences([[i % 32] * 200 for i in range(256)], [[1] * 50] * 256)
    t = time.perf_counter()
    packed = PromptSharing(COST, force=force)(b, 50)
    assert packed is not None and packed.input_ids.shape[0] == 32
    assert time.perf_counter() - t < 10.0
