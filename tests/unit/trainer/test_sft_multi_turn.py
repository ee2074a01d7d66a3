"""Multi-turn SFT rows: a demonstration (assistant, tool, assistant) is laid out as the multi_turn
rollout lays out an episode, with the loss on the assistant's tokens (and the final EOS) only."""
import pytest

from verl_hpc.data.prepare.tool_arith import demonstration
from verl_hpc.rollout.episodes.chat_turns import TurnCodec
from verl_hpc.trainer.programs.sft import _multi_turn_problem, episode_response, loss_mask


@pytest.fixture(scope="module")
def tok():
    from verl_hpc.models.tiny import train_tokenizer

    return train_tokenizer()


def test_demonstration_layout_and_mask(tok):
    messages = demonstration(12345, 67890)
    ids, mask = episode_response(TurnCodec(tok), messages, tok.eos_token_id)
    call, product = messages[0]["content"], messages[1]["content"]
    want = (call + "<|im_end|>\n<|im_start|>tool\n" + product + "<|im_end|>\n<|im_start|>assistant\n" + product
            + "<|eos|>")
    assert tok.decode(ids) == want
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, tail = enc(call), enc("<|im_end|>\n<|im_start|>tool\n" + product + "<|im_end|>\n<|im_start|>assistant\n")
    assert ids[:len(first)] == first and ids[len(first):len(first) + len(tail)] == tail
    assert mask == [1] * len(first) + [0] * len(tail) + [1] * (len(ids) - len(first) - len(tail))
    # the batch's loss mask keeps it; a plain row (mask None) is trained on every token
    m = loss_mask([(ids, mask), ([5, 6, tok.eos_token_id], None)])
    assert m[0].tolist() == [float(x) for x in mask] and m[1, :3].tolist() == [1.0, 1.0, 1.0]
    assert m[1, 3:].sum() == 0


@pytest.mark.parametrize("bad, why", [
    ([{"role": "tool", "content": "1"}, {"role": "assistant", "content": "1"}], "starts and ends with an assistant"),
    ([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "1"}], "starts and ends with an assistant"),
    ([{"role": "assistant"}], "list of {role, content} messages"),
    ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "a"}], "list of {role, content}"),
    ([{"role": "assistant", "content": ""}, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "1"}],
     "an assistant message is empty"),
])
def test_malformed_demonstrations_are_named(bad, why):
    assert why in _multi_turn_problem(bad)
