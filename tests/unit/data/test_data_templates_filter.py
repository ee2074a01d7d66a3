"""Chat templates, tokenisation and the prompt length filter."""
import logging

import pytest

from verl_hpc.config.schema import choices_of
from verl_hpc.data import DataError, PromptDataset, encode_prompts, render_prompt
from verl_hpc.data.filtering import OVERLONG_MODES, filter_overlong
from data_options import dataset_args


def test_plain_text_is_wrapped_as_a_user_message(tokenizer):
    text, templated = render_prompt(tokenizer, "3+4=")
    assert templated and text == "<s><|user|>3+4=</s><|assistant|>"
    chat = [{"role": "user", "content": "3+4="}]
    assert render_prompt(tokenizer, chat) == (text, True)  # same text whichever way a file stores it


def test_raw_text_when_asked_or_without_a_template(tokenizer, plain_tokenizer):
    assert render_prompt(tokenizer, "3+4=", wrap_plain_text=False) == ("3+4=", False)
    assert render_prompt(plain_tokenizer, "3+4=") == ("3+4=", False)
    with pytest.raises(DataError, match="no chat_template"):
        render_prompt(plain_tokenizer, [{"role": "user", "content": "hi"}])


def test_template_failures_name_the_sample(files, tokenizer, plain_tokenizer, make_tokenizer):
    chat = {"prompt": [{"role": "user", "content": "hi"}], "data_source": "m", "ground_truth": "1"}
    path = files.jsonl("chat.jsonl", [files.row(0), chat])
    with pytest.raises(DataError, match="sample chat.jsonl:1: a prompt is a list of chat messages but the tokenizer"):
        PromptDataset.load([path], plain_tokenizer, **dataset_args())
    strict = make_tokenizer()  # a template with its own rule, as many instruct models have
    strict.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                            + tokenizer.chat_template)
    sys_row = {**chat, "prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]}
    with pytest.raises(DataError, match=r"sample sys.jsonl:0: the tokenizer's chat_template cannot render.*no system"):
        PromptDataset.load([files.jsonl("sys.jsonl", [sys_row])], strict, **dataset_args())


def test_token_ids_have_exactly_one_bos(tokenizer):
    bos = tokenizer.bos_token_id
    texts, ids = encode_prompts(tokenizer, ["3+4=", [{"role": "user", "content": "3+4="}]])
    assert ids[0] == ids[1] and ids[0].count(bos) == 1 and ids[0][0] == bos
    assert tokenizer.decode(ids[0]) == texts[0]
    _, raw = encode_prompts(tokenizer, ["3+4="], wrap_plain_text=False)  # the tokenizer adds its BOS
    assert raw[0][0] == bos and raw[0].count(bos) == 1


def test_filter_drops_with_a_count_and_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="verl_hpc.data.filtering"):
        kept, dropped = filter_overlong(["a:0", "a:1", "a:2"], [5, 11, 10], 10, "drop")
    assert (kept, dropped) == ([0, 2], 1)
    assert "dropped 1 of 3 prompts longer than data.max_prompt_length = 10" in caplog.text


def test_filter_error_mode_names_the_row():
    with pytest.raises(DataError) as e:
        filter_overlong(["a.jsonl:0", "a.jsonl:1"], [5, 11], 10, "error")
    assert "sample a.jsonl:1: prompt is 11 tokens, over data.max_prompt_length = 10" in str(e.value)
    assert "data.overlong_prompts=drop" in str(e.value)
    with pytest.raises(DataError, match="data.overlong_prompts: invalid value 'skip'; valid: drop, error"):
        filter_overlong(["a:0"], [1], 10, "skip")


def test_overlong_modes_are_the_config_choices():
    assert set(choices_of("data.overlong_prompts")) == set(OVERLONG_MODES)


def test_dataset_applies_template_and_filter(files, tokenizer):
    long_q = "How many clips did Natalia sell altogether in April and May? " * 5
    path = files.jsonl("d.jsonl", [files.row(0), {**files.row(1), "prompt": long_q}, files.row(2)])
    limit = len(encode_prompts(tokenizer, [files.row(0)["prompt"]])[1][0]) + 2
    ds = PromptDataset.load([path], tokenizer, **dataset_args(max_prompt_length=limit))
    assert len(ds) == 2 and ds.n_dropped == 1
    assert [r.id for r in ds.records] == ["d.jsonl:0", "d.jsonl:2"]
    assert ds.texts[0].startswith("<s><|user|>What is 0") and all(len(x) <= limit for x in ds.token_ids)
    with pytest.raises(DataError, match=r"sample d.jsonl:1: prompt is \d+ tokens"):
        PromptDataset.load([path], tokenizer, **dataset_args(max_prompt_length=limit, overlong_prompts="error"))
    with pytest.raises(DataError, match="all 3 prompts are longer than data.max_prompt_length = 2"):
        PromptDataset.load([path], tokenizer, **dataset_args(max_prompt_length=2))
    with pytest.raises(DataError, match="data.val_files: empty"):
        PromptDataset.load([], tokenizer, what="data.val_files", **dataset_args())
