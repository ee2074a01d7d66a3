"""The engines' batch format (verl_hpc.engines.batch) and micro-batch tensors (schedule.MicroBatch)."""
import pytest
import torch

from verl_hpc.engines.batch import (check_batch, get_response_mask, pack_sequences, response_positions,
                                    response_tokens, select_rows)


def _batch():
    b = pack_sequences([[11, 12, 13], [21], [31, 32]], [[14, 15], [22, 23, 24], [33]], pad_id=0)
    b["advantages"] = torch.arange(9, dtype=torch.float32).view(3, 3)
    b["scores"] = torch.tensor([1.0, 2.0, 3.0])
    return b


def test_pack_sequences_right_pads_prompt_then_response():
    b = _batch()
    assert b["input_ids"].tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 0], [31, 32, 33, 0, 0]]
    assert b["prompt_lengths"].tolist() == [3, 1, 2] and b["response_lengths"].tolist() == [2, 3, 1]
    assert get_response_mask(b).tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]


def test_response_token_t_is_predicted_from_position_p_plus_t_minus_1():
    b = _batch()
    pos = response_positions(b["prompt_lengths"], 3, 5)
    tok = response_tokens(b["input_ids"], b["prompt_lengths"], 3)
    assert pos[0].tolist()[:2] == [2, 3] and tok[0].tolist()[:2] == [14, 15]
    assert pos[1].tolist() == [0, 1, 2] and tok[1].tolist() == [22, 23, 24]
    assert tok[2, 0] == 33 and pos[2, 0] == 1


def test_check_batch_names_the_problem():
    b = _batch()
    check_batch(b)
    with pytest.raises(ValueError, match="missing 'prompt_lengths'"):
        check_batch({"input_ids": b["input_ids"], "response_lengths": b["response_lengths"]})
    bad = dict(b, response_lengths=torch.tensor([2, 3, 9]))
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        check_batch(bad)
    bad = dict(b, response_mask=torch.ones(3, 3))
    with pytest.raises(ValueError, match="0 beyond response_lengths"):
        check_batch(bad)
    empty = dict(b, response_lengths=torch.tensor([2, 0, 1]))
    with pytest.raises(ValueError):
        check_batch(empty)
    check_batch(empty, need_response=False)  # forward-only roles accept empty responses


def test_select_rows_cuts_to_the_rows_own_lengths():
    sub = select_rows(_batch(), [2, 0])
    assert sub["input_ids"].tolist() == [[31, 32, 33, 0, 0], [11, 12, 13, 14, 15]]
    sub = select_rows(_batch(), [2])
    assert sub["input_ids"].tolist() == [[31, 32, 33]]
    assert sub["advantages"].tolist() == [[6.0]] and sub["scores"].tolist() == [3.0]
    assert sub["response_mask"].tolist() == [[1.0]]
    assert select_rows(_batch(), [2], pad_seq_to=4)["input_ids"].shape == (1, 4)


def test_select_rows_pads_past_the_batch_width_to_the_multiple():
    """Rounding up to pad_seq_to (FP8's token alignment, the TP size under sequence parallelism)
    was capped at the batch's own width: a batch 5 tokens wide stayed 5 instead of 8."""
    sub = select_rows(_batch(), [0, 1], pad_seq_to=4)
    assert sub["input_ids"].tolist() == [[11, 12, 13, 14, 15, 0, 0, 0], [21, 22, 23, 24, 0, 0, 0, 0]]
    assert sub["response_mask"].shape == (2, 3)  # responses keep their own width


def test_micro_batch_padding_rows_are_cut_before_the_loss():
    from verl_hpc.engines.megatron.schedule import MicroBatch

    mb = MicroBatch(_batch(), [1], "cpu", 1, shape=(2, 6))
    assert mb.data["input_ids"].shape == (2, 6) and mb.real_rows == 1 and mb.tokens == 3.0
    out, data = mb.loss_view(torch.zeros(2, 6, 7))
    assert out.shape == (1, 6, 7) and data["input_ids"].tolist() == [[21, 22, 23, 24, 0, 0]]
    assert data["_targets"].tolist() == [[22, 23, 24]]
    dummy = MicroBatch(_batch(), [], "cpu", 1)
    assert dummy.dummy and dummy.tokens == 0.0
