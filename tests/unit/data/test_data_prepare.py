"""The preprocessors as users run them: `python -m verl_hpc.data.prepare ...` on files the test writes."""
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from verl_hpc.data import PromptDataset
from verl_hpc.data.prepare import synthetic
from verl_hpc.rewards.registry import default_score
from data_options import dataset_args


# GSM8K's public format, rows written here: calculator annotations, '$', thousands separators
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A house costs $1,200 a month to rent. How much is a year's rent?",
     "answer": "A year has 12 months, so the rent is 12 * $1,200 = $<<12*1200=14400>>14,400.\n#### 14,400"},
]
MATH = [
    {"problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.", "level": "Level 1", "type": "Prealgebra",
     "solution": "We have $\\frac{1}{2}+\\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
    {"problem": "Simplify $\\sqrt{8}$.", "level": "Level 2", "type": "Algebra",
     "solution": "First $\\boxed{4}$ is wrong; $\\sqrt{8} = \\boxed{2\\sqrt{2}}$."},
]


def prepare(*args):
    return subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.heavy
def test_gsm8k_cli(files, tmp_path):
    out = tmp_path / "gsm8k.parquet"
    proc = prepare("gsm8k", files.jsonl("test.jsonl", GSM8K), out)
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out).to_pylist()
    assert [r["ground_truth"] for r in rows] == ["72", "14400"]  # commas removed
    assert all(r["data_source"] == "gsm8k" and '"####"' in r["prompt"] for r in rows)
    assert rows[0]["prompt"].startswith("Natalia sold clips")
    for r in rows:  # the reference solution scores 1.0 against the prepared ground truth
        assert default_score(r["data_source"], r["extra"]["reference_solution"], r["ground_truth"]) == 1.0


@pytest.mark.heavy
def test_math_cli(files, tmp_path):
    out = tmp_path / "math.parquet"
    proc = prepare("math", files.jsonl("math.jsonl", MATH), out)
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out).to_pylist()
    assert [r["ground_truth"] for r in rows] == ["\\frac{3}{4}", "2\\sqrt{2}"]  # nested braces, last box
    assert rows[1]["extra"]["level"] == "Level 2" and "\\boxed{}" in rows[0]["prompt"]
    for r in rows:
        assert default_score("math", r["extra"]["reference_solution"], r["ground_truth"]) == 1.0


@pytest.mark.parametrize("task,rows,message", [
    ("gsm8k", [GSM8K[0], {"question": "q", "answer": "no final line"}], "row 1 (line 2): field 'answer' has no final"),
    ("gsm8k", [{"answer": "#### 3"}], "row 0 (line 1): field 'question' is missing"),
    ("math", [MATH[0], {"problem": "p", "solution": "x = \\boxed{3"}],
     "row 1 (line 2): field 'solution' has no complete"),
])
@pytest.mark.heavy
def test_bad_input_rows_exit_10_naming_the_line(files, tmp_path, task, rows, message):
    proc = prepare(task, files.jsonl("in.jsonl", rows), tmp_path / "out.parquet")
    assert proc.returncode == 10 and message in proc.stderr and "Traceback" not in proc.stderr  # DataError's code
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.heavy
def test_synthetic_cli_is_loadable_and_seeded(tmp_path, tokenizer):
    args = ("--n-train", 400, "--n-val", 50, "--seed", 4, "--sft-noise", 0.6)
    assert prepare("synthetic", tmp_path / "a", *args).returncode == 0
    assert prepare("synthetic", tmp_path / "b", *args).returncode == 0
    for name in ("train", "val", "sft"):
        assert pq.read_table(tmp_path / "a" / f"{name}.parquet") == pq.read_table(tmp_path / "b" / f"{name}.parquet")
    train = PromptDataset.load([str(tmp_path / "a" / "train.parquet")], tokenizer,
                              **dataset_args(max_prompt_length=16))
    assert len(train) == 400 and train.n_dropped == 0 and train.records[0].data_source == "synthetic_arith"
    sft = pq.read_table(tmp_path / "a" / "sft.parquet").to_pylist()
    assert len(sft) == 400 and {"prompt", "response", "ground_truth"} <= set(sft[0])
    noisy = [r for r in sft if r["extra"]["noisy"]]
    assert 0.5 < len(noisy) / len(sft) < 0.7
    assert all(int(r["response"]) == int(r["ground_truth"]) + 1 for r in noisy)  # the systematic distractor
    assert all(r["response"] == r["ground_truth"] for r in sft if not r["extra"]["noisy"])


def test_synthetic_difficulty_and_noise_kinds():
    easy = synthetic.generate(200, 10, difficulty=1)
    assert all(r["extra"]["a"] <= 4 and r["extra"]["b"] <= 4 for r in easy["train"])
    assert all(r["prompt"] == f"{r['extra']['a']}+{r['extra']['b']}=" for r in easy["train"])
    hard = synthetic.generate(200, 10, difficulty=3)
    assert max(r["extra"]["a"] for r in hard["train"]) > 9
    rand = synthetic.generate(300, 10, sft_noise=1.0, noise_kind="random")["sft"]
    assert all(r["response"] != r["ground_truth"] for r in rand)
    assert len({int(r["response"]) - int(r["ground_truth"]) for r in rand}) > 5
    assert synthetic.generate(20, 10, seed=1)["train"] != synthetic.generate(20, 10, seed=2)["train"]
