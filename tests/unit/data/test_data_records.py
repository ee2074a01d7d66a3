"""Reading prompt files: both formats, stable ids, and bad rows named by file, row, line and field."""
import pytest

from verl_hpc.data import DataError, load_records, read_rows
from data_options import DATA


TEXT_ROWS = [{"prompt": "What is 1 plus 1?", "data_source": "gsm8k", "ground_truth": 2, "extra": {"level": 1}},
             {"prompt": "Half of 7?", "data_source": "math", "ground_truth": 3.5, "extra": {"tag": "x"}}]
CHAT_ROWS = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
              "data_source": "math", "ground_truth": "4"}]


@pytest.mark.parametrize("rows", [TEXT_ROWS, CHAT_ROWS], ids=["text", "chat"])
def test_jsonl_and_parquet_read_the_same_records(files, rows):
    a = load_records([files.jsonl("a.jsonl", rows)], DATA.prompt_key)
    b = load_records([files.parquet("a.parquet", rows)], DATA.prompt_key)
    assert [r.id for r in a] == [f"a.jsonl:{i}" for i in range(len(rows))]
    assert [r.id for r in b] == [f"a.parquet:{i}" for i in range(len(rows))]
    for r, s in zip(a, b):
        assert (r.prompt, r.data_source, r.ground_truth, r.extra) == (s.prompt, s.data_source, s.ground_truth, s.extra)


def test_fields_are_normalised(files):
    text = load_records([files.parquet("t.parquet", TEXT_ROWS)], DATA.prompt_key)
    assert text[0].extra == {"level": 1} and text[1].extra == {"tag": "x"}  # Arrow's null-filled keys dropped
    assert [r.ground_truth for r in text] == ["2", "3.5"]  # numbers kept as their text
    assert not text[0].is_chat
    chat = load_records([files.parquet("c.parquet", CHAT_ROWS)], DATA.prompt_key)[0]
    assert chat.is_chat and chat.prompt[1] == {"role": "user", "content": "2+2?"}


def test_prompt_key_selects_the_column(files):
    path = files.jsonl("m.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "data_source": "math",
                                    "ground_truth": "1"}])
    assert load_records([path], "messages")[0].prompt == [{"role": "user", "content": "hi"}]
    with pytest.raises(DataError, match=r"'prompt' \(data.prompt_key\) is missing"):
        load_records([path], DATA.prompt_key)


def test_mixed_types_across_rows_fall_back_to_line_reading(files):
    path = files.jsonl("mixed.jsonl", [files.row(0, truth=5), files.row(1, truth="five")])
    assert [r.ground_truth for r in load_records([path], DATA.prompt_key)] == ["5", "five"]


def test_same_file_name_in_two_folders_keeps_ids_unique(files, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a = files.jsonl("x/d.jsonl", [files.row(0)])
    b = files.jsonl("y/d.jsonl", [files.row(0)])
    ids = [r.id for r in load_records([a, b], DATA.prompt_key)]
    assert len(set(ids)) == 2 and ids[0].endswith("x/d.jsonl:0")


BAD_ROWS = [
    ({"prompt": "q", "data_source": "gsm8k"}, "field 'ground_truth' is missing"),
    ({"prompt": "  ", "data_source": "gsm8k", "ground_truth": "1"}, "field 'prompt' is empty"),
    ({"data_source": "gsm8k", "ground_truth": "1"}, "field 'prompt' (data.prompt_key) is missing"),
    ({"prompt": "q", "ground_truth": "1"}, "field 'data_source' is missing"),
    ({"prompt": ["hello"], "data_source": "m", "ground_truth": "1"}, "expected a list of {role, content} dicts"),
    ({"prompt": [{"role": "robot", "content": "x"}], "data_source": "m", "ground_truth": "1"},
     "unknown role 'robot'; valid: system, user, assistant, tool"),
    ({"prompt": [{"role": "user", "content": 3}], "data_source": "m", "ground_truth": "1"}, "expected text"),
    ({"prompt": [], "data_source": "m", "ground_truth": "1"}, "empty list of messages"),
    ({"prompt": 42, "data_source": "m", "ground_truth": "1"}, "field 'prompt' is int"),
    ({"prompt": "q", "data_source": "m", "ground_truth": ["a"]}, "field 'ground_truth' is list"),
    ({"prompt": "q", "data_source": "m", "ground_truth": True}, "field 'ground_truth' is bool"),
    ({"prompt": "q", "data_source": "m", "ground_truth": "1", "extra": [1]}, "field 'extra' is list"),
]


@pytest.mark.parametrize("bad,message", BAD_ROWS, ids=[m[:30] for _, m in BAD_ROWS])
def test_bad_row_names_file_row_line_and_field(files, bad, message):
    # the bad row is row 2, on line 4 because of a blank line after row 0
    path = files.jsonl("bad.jsonl", [files.row(0), files.row(1), bad], blank_after=(0,))
    with pytest.raises(DataError) as e:
        load_records([path], DATA.prompt_key)
    assert f"'{path}' row 2 (line 4): " in str(e.value)
    assert message in str(e.value)


def test_bad_parquet_row_names_row(files):
    path = files.parquet("bad.parquet", [files.row(0), {**files.row(1), "ground_truth": None}])
    with pytest.raises(DataError, match=r"bad.parquet' row 1: field 'ground_truth' is missing"):
        load_records([path], DATA.prompt_key)


def test_all_problems_in_one_error(files):
    rows = [{"prompt": "q", "data_source": "m"} for _ in range(15)]
    with pytest.raises(DataError) as e:
        load_records([files.jsonl("many.jsonl", rows)], DATA.prompt_key)
    assert str(e.value).startswith("15 problems in the data:") and "... and 5 more" in str(e.value)
    assert len(e.value.problems) == 15


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "q", "data_source": "m", ground_truth: 1}', "line 2: invalid JSON"),
    ('[1, 2]', "line 2: expected a JSON object"),
])
def test_broken_jsonl_names_the_line(files, content, message):
    path = files.jsonl("broken.jsonl", [files.row(0), content])
    with pytest.raises(DataError, match=message):
        read_rows(path)


def test_missing_unknown_and_empty_files(files, tmp_path):
    with pytest.raises(DataError, match="nope.jsonl': no such file"):
        load_records([str(tmp_path / "nope.jsonl")], DATA.prompt_key)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown file type; valid: .parquet"):
        load_records([str(tmp_path / "x.csv")], DATA.prompt_key)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl': no rows"):
        load_records([str(tmp_path / "empty.jsonl")], DATA.prompt_key)
