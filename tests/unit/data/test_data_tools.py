"""multi_turn rows: the `tools` field picks the tool schemas the chat template lists in the prompt;
a row naming a tool the job does not have is a DataError naming the row and the valid tools."""
import json

import pytest

from verl_hpc.data import DataError
from verl_hpc.data.dataset import PromptDataset

TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SCHEMAS = {name: {"type": "function", "function": {"name": name, "description": name, "parameters": {}}}
           for name in ("calculator", "python")}


@pytest.fixture
def tok():
    from verl_hpc.models.tiny import train_tokenizer

    t = train_tokenizer()
    t.chat_template = TEMPLATE
    return t


def write(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(tok, path, tools):
    return PromptDataset.load([path], tok, "prompt", 64, "error", True, tools=tools)


def test_rows_list_their_tools_in_the_prompt(tok, tmp_path):
    path = write(tmp_path, [{"prompt": "1*2=", "data_source": "tool_arith", "ground_truth": "2", "tools": ["calculator"]},
                            {"prompt": "3*4=", "data_source": "tool_arith", "ground_truth": "12"}])
    ds = load(tok, path, SCHEMAS)
    assert ds.texts[0].startswith("TOOLS:calculator;<|im_start|>")
    assert ds.texts[1].startswith("TOOLS:calculator;python;<|im_start|>")  # no field: every tool
    assert ds.batch([0]).extras[0]["tools"] == ["calculator"]
    assert not load(tok, path, None).texts[0].startswith("TOOLS")  # single-turn jobs: unchanged


def test_a_row_naming_an_unknown_tool_is_refused(tok, tmp_path):
    path = write(tmp_path, [{"prompt": "1*2=", "data_source": "tool_arith", "ground_truth": "2", "tools": ["search"]}])
    with pytest.raises(DataError, match=r"rows.jsonl:0: field 'tools' names 'search'.*valid: calculator, python"):
        load(tok, path, SCHEMAS)


def test_a_tools_field_of_the_wrong_type_is_a_row_error(tok, tmp_path):
    path = write(tmp_path, [{"prompt": "1*2=", "data_source": "tool_arith", "ground_truth": "2", "tools": "calculator"}])
    with pytest.raises(DataError, match="field 'tools'.*expected a list of tool names"):
        load(tok, path, SCHEMAS)


def test_tool_arith_rows():
    """The tool demo's data: rows the job accepts, products as ground truth, the SFT noise share."""
    from verl_hpc.data.prepare.tool_arith import generate
    from verl_hpc.data.records import row_problems

    rows = generate(50, 10, seed=1, sft_noise=0.75, n_sft=400)
    assert [len(rows[k]) for k in ("train", "val", "sft")] == [50, 10, 400]
    for r in rows["train"] + rows["val"]:
        assert row_problems(r, "prompt") == [] and r["tools"] == ["calculator"]
        assert int(r["ground_truth"]) == r["extra"]["a"] * r["extra"]["b"] and 10_000 <= r["extra"]["a"] <= 99_999
    direct = [r for r in rows["sft"] if r["extra"]["direct"]]
    assert 0.65 < len(direct) / 400 < 0.85
    assert all(r["response"][0]["content"].startswith("about ") for r in direct)
    demos = [r for r in rows["sft"] if not r["extra"]["direct"]]
    assert all(r["response"][1]["content"] == r["ground_truth"] == r["response"][2]["content"] for r in demos)
