"""Bad inputs a new user sends (issue 11), each answered with one line naming the field, file or
row and what is valid: config integers, values that would reach the sbatch script, data bytes."""
import os
import time
from pathlib import Path

import pytest

from verl_hpc.config import ConfigError, load_config, validate
from verl_hpc.data.errors import DataError
from verl_hpc.data.records import load_records, read_rows

OK = ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2"]


def one_line(exc) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ------------------------------------------------------------------ integers that are not decimal
@pytest.mark.parametrize("override,shown", [
    ("trainer.total_steps=0x10", "'0x10'"),
    ("data.train_batch_size=0o10", "'0o10'"),
    ("slurm.time_min=1:30", "'1:30'"),  # YAML 1.1 sexagesimal: 90
    ("rollout.n=0b11", "'0b11'"),
])
def test_non_decimal_int_on_the_command_line_is_an_error(override, shown):
    with pytest.raises(ConfigError) as e:
        load_config(None, OK + [override])
    key = override.split("=")[0]
    assert one_line(e.value).startswith(f"{key}: expected int, got {shown}"), e.value


def test_non_decimal_int_in_a_file_names_the_line(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("trainer:\n  total_steps: 0x10\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, [])
    assert one_line(e.value) == (f"trainer.total_steps: expected int, got '0x10' (from {f}, line 2)"), e.value


def test_decimal_ints_and_hex_text_in_str_fields_still_load():
    cfg = load_config(None, ["trainer.total_steps=1_000", "trainer.experiment_name=0x10"])
    assert cfg.trainer.total_steps == 1000 and cfg.trainer.experiment_name == "0x10"


# ------------------------------------------------------------------ '#' and line breaks in a CLI value
def test_a_cli_value_keeps_its_hash_and_line_breaks():
    """The shell has split the words already: a '#' is text, never a YAML comment."""
    cfg = load_config(None, OK + ["trainer.experiment_name=run #3", "trainer.project_name=a#b",
                                  "slurm.setup=[x, '#y']", "slurm.env={A: '#1'}", "checkpoint.dir=#ck"])
    assert cfg.trainer.experiment_name == "run #3" and cfg.trainer.project_name == "a#b"
    assert cfg.slurm.setup == ["x", "#y"] and cfg.slurm.env["A"] == "#1" and cfg.checkpoint.dir == "#ck"
    cfg = load_config(None, OK + ["trainer.experiment_name=line 1\nline 2"])
    assert cfg.trainer.experiment_name == "line 1\nline 2"  # whole, not folded into 'line 1 line 2'


def test_a_comment_typed_inside_one_shell_word_is_part_of_the_value():
    with pytest.raises(ConfigError) as e:
        load_config(None, OK + ["trainer.total_steps=10 # ten"])
    assert one_line(e.value).startswith("trainer.total_steps: expected int, got '10 # ten'"), e.value


def test_a_raw_newline_cannot_hide_an_sbatch_line():
    cfg = load_config(None, OK + ["slurm.partition=gpu\n#SBATCH --qos=high"])  # was read as 'gpu'
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_model=False)
    assert one_line(e.value).startswith("slurm.partition: contains character '\\n'"), e.value


# ------------------------------------------------------------------ values that reach the sbatch script
# YAML double quotes turn \\n into a newline (a raw newline is kept as typed: see above)
@pytest.mark.parametrize("override,message", [
    ('slurm.additional.comment="x\\n#SBATCH --uid=0"',
     "slurm.additional.comment: contains character '\\n'; valid: a one-line value"),
    ('slurm.additional={"mail-type\\n#SBATCH --uid": 0}',
     "slurm.additional: 'mail-type\\n#SBATCH --uid' is not an sbatch option name"),
    ('slurm.env.FOO="a\\nrm -rf ~"', "slurm.env.FOO: contains character '\\n'; valid: a one-line value"),
    ("slurm.env={'A B': x}", "slurm.env: 'A B' is not an environment variable name"),
    ("slurm.env={'1X': x}", "slurm.env: '1X' is not an environment variable name"),
    ('slurm.setup=["module load x\\r#SBATCH --exclusive"]', "slurm.setup[0]: contains character '\\r'"),
    ('slurm.partition="gpu\\n#SBATCH --qos=high"', "slurm.partition: contains character '\\n'"),
    ('slurm.job_name="a\\x1b[2Jb"', "slurm.job_name: contains character '\\x1b'"),
    ('slurm.container.mounts=["/a:/a\\n/b"]', "slurm.container.mounts[0]: contains character '\\n'"),
])
def test_sbatch_injection_is_refused(override, message):
    cfg = load_config(None, OK + [override])
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_model=False)
    assert len(e.value.problems) == 1 and one_line(e.value).startswith(message), e.value


# ------------------------------------------------------------------ data bytes
def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_bytes(b'{"prompt": "a", "data_source": "gsm8k", "ground_truth": "1"}\n\n'
                  b'{"prompt": "caf\xe9", "data_source": "gsm8k", "ground_truth": "1"}\n')
    for read in (lambda: read_rows(str(f)), lambda: load_records([str(f)], "prompt")):
        with pytest.raises(DataError) as e:
            read()
        assert one_line(e.value).endswith(f" file '{f}' line 3: byte 0xe9 at column 16 is not UTF-8; JSONL files "
                                     "must be UTF-8 text (re-save the file as UTF-8)"), e.value


# ------------------------------------------------------------------ the local failure summary
def test_local_failure_summary_puts_the_rank_that_died_first_first(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from verl_hpc.launcher.local import by_time_of_death

    now = time.time()
    for rank, died, in ((0, now - 1), (1, now - 5), (2, now - 3)):  # rank 1 died first
        log = tmp_path / "run1" / "attempt_0" / str(rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text("...")
        os.utime(log, (died, died))
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=code, error_file=str(tmp_path / "none"))
                for r, code in ((0, 1), (1, 3), (2, -15))}
    assert by_time_of_death(failures, Path(tmp_path)) == [1, 2, 0]


# ------------------------------------------------------------------ files checked before the queue
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from verl_hpc.launcher.preflight import preflight  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROW = {"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    # in this process: the command line's start-up (7 CPU-s) checks nothing here; tests/jobs.py's
    # assets and tests/unit/test_cli_errors.py run the command
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2)


@pytest.fixture
def job(tmp_path, tiny_model):
    """A valid RL job's files (model copy, one parquet, one JSONL); returns (overrides, paths)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    train, val = tmp_path / "train.parquet", tmp_path / "val.jsonl"
    pq.write_table(pa.Table.from_pylist([ROW] * 8), train)  # the default batch: 8 prompts
    val.write_text("".join(json.dumps(ROW) + "\n" for _ in range(4)))
    paths = dict(model=model, train=train, val=val, out=tmp_path / "out")
    overrides = [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                 f"trainer.output_dir={paths['out']}", f"slurm.log_dir={tmp_path}/logs/%j", "rollout.n=2"]
    return overrides, paths


def preflight_problem(overrides) -> str:
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert len(e.value.problems) == 1, e.value
    return one_line(e.value)


@pytest.mark.heavy
def test_preflight_passes_a_good_job(job):
    preflight(load_config(None, job[0]))


def _set_train(overrides, path):
    return [o for o in overrides if not o.startswith("data.train_files=")] + [f"data.train_files=[{path}]"]


@pytest.mark.parametrize("make,message", [
    (lambda t: t / "nope.parquet", "data.train_files: '{f}': no such file"),
    (lambda t: (t / "d.parquet").mkdir() or t / "d.parquet",
     "data.train_files: '{f}' is a folder; expected a parquet or JSONL file"),
    (lambda t: (t / "a.csv").write_text("x") and t / "a.csv",
     "data.train_files: '{f}': unknown file type; valid: .parquet, .pq, .jsonl, .json, .ndjson"),
    (lambda t: (t / "e.jsonl").write_text("\n\n") and t / "e.jsonl", "data.train_files file '{f}': no rows"),
    (lambda t: (t / "b.jsonl").write_text(json.dumps(ROW) + "\n{oops\n") and t / "b.jsonl",
     "data.train_files file '{f}' line 2: invalid JSON"),
    (lambda t: (t / "l.jsonl").write_text("[1, 2]\n") and t / "l.jsonl",
     "data.train_files file '{f}' line 1: expected a JSON object, got list"),
    (lambda t: (t / "m.jsonl").write_text('{"prompt": "x", "data_source": "gsm8k"}\n') and t / "m.jsonl",
     "data.train_files: '{f}' row 0 (line 1): field 'ground_truth' is missing; expected the reference answer"),
    (lambda t: (t / "u.jsonl").write_bytes(b'{"prompt": "\xff"}\n') and t / "u.jsonl",
     "data.train_files file '{f}' line 1: byte 0xff at column 13 is not UTF-8"),
])
def test_preflight_data_files(job, tmp_path, make, message):
    f = make(tmp_path)
    assert preflight_problem(_set_train(job[0], f)).startswith(message.format(f=f))


def test_preflight_refuses_a_row_offering_an_unknown_tool(job):
    """multi_turn: a row's `tools` naming a tool the job does not have is refused before the queue,
    naming the row and the valid tools (parquet: the `tools` column is read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = job[1]["train"]
    pq.write_table(pa.Table.from_pylist([dict(ROW, tools=["calculator"])] * 7 + [dict(ROW, tools=["search"])]), train)
    message = preflight_problem([*job[0], "multi_turn.enable=true", "multi_turn.tools=[calculator]"])
    assert message.startswith(f"data.train_files: '{train}' row 7: field 'tools' names 'search', not a tool of "
                              "this job; valid: calculator"), message


def test_preflight_truncated_parquet(job):
    train = job[1]["train"]
    train.write_bytes(train.read_bytes()[:-20])
    assert preflight_problem(job[0]).startswith(f"data.train_files: '{train}': not a readable parquet file")


def test_preflight_parquet_without_a_column(job):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "ground_truth": "1"}]), job[1]["train"])
    assert preflight_problem(job[0]) == (f"data.train_files: '{job[1]['train']}': no column 'data_source' "
                                         "(columns: prompt, ground_truth)")


def test_preflight_unsupported_architecture(job):
    cfg_file = job[1]["model"] / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps(dict(cfg, architectures=["DeepseekV2ForCausalLM"])))
    assert preflight_problem(job[0]).startswith(
        f"model.path: {cfg_file}: architectures=['DeepseekV2ForCausalLM'] is not mapped into Megatron; mapped: LlamaForCausalLM")


def _weights(job):
    return sorted(job[1]["model"].glob("*.safetensors"))[0]


@pytest.mark.parametrize("damage,words", [
    (lambda b: b[:-100], "truncated: its header covers {n} bytes, the file has {m}"),
    (lambda b: b + b"\0" * 8, "has trailing bytes: its header covers {n} bytes, the file has {m}"),
    (lambda b: b[:6], "6 bytes, too short for a safetensors header"),
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], "header length 1000000000000 exceeds the file"),
])
def test_preflight_damaged_safetensors(job, damage, words):
    f = _weights(job)
    whole = f.read_bytes()
    f.write_bytes(damage(whole))
    expected = words.format(n=len(whole), m=f.stat().st_size)
    assert preflight_problem(job[0]) == f"model.path: '{f}': {expected}" or expected in preflight_problem(job[0])


def test_preflight_index_names_a_missing_shard(job):
    index = job[1]["model"] / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": _weights(job).name, "b": "model-00002-of-00002.safetensors"}}))
    assert preflight_problem(job[0]) == f"model.path: '{index}' names missing file(s): model-00002-of-00002.safetensors"


def test_preflight_model_without_weights(job):
    for f in job[1]["model"].glob("*.safetensors"):
        f.unlink()
    assert preflight_problem(job[0]) == (f"model.path: '{job[1]['model']}' has no *.safetensors files; "
                                         "expected a Hugging Face model folder")


def test_preflight_checks_the_teachers_files_and_sources(job, tmp_path):
    """On-policy distillation before the queue: a teacher folder's weights are checked like the
    student's, and with teacher.by_data_source only, a training row whose source has no teacher is
    named (a split job's training ranks would meet it only at the step that draws it)."""
    teacher = tmp_path / "teacher"
    shutil.copytree(job[1]["model"], teacher)
    on = [*job[0], "algorithm.recipe=grpo", "teacher.enable=true"]
    preflight(load_config(None, [*on, f"teacher.model_path={teacher}"]))  # a good teacher passes
    assert preflight_problem([*on, f"teacher.by_data_source={{math: {teacher}}}"]) == (
        f"data.train_files: '{job[1]['train']}' row 0: teacher.by_data_source has no teacher for data_source "
        "'gsm8k' (listed: math) and teacher.model_path is empty; add it or set teacher.model_path as the "
        f"teacher of the rest (and 7 more in '{job[1]['train']}')")
    preflight(load_config(None, [*on, f"teacher.by_data_source={{gsm8k: {teacher}}}"]))
    for f in teacher.glob("*.safetensors"):
        f.unlink()
    assert preflight_problem([*on, f"teacher.model_path={teacher}"]) == (
        f"teacher.model_path: '{teacher}' has no *.safetensors files; expected a Hugging Face model folder")


def test_preflight_output_dir_is_a_file(job):
    job[1]["out"].write_text("not a folder")
    text = preflight_problem(job[0] + [f"checkpoint.dir={job[1]['out'].parent}/ck"])
    assert text == (f"trainer.output_dir: '{job[1]['out']}' is a file, not a folder; valid: a writable folder "
                    "or a path that can be created"), text


def test_preflight_checkpoint_dir_under_a_file(job, tmp_path):
    (tmp_path / "f").write_text("x")
    text = preflight_problem(job[0] + [f"checkpoint.dir={tmp_path}/f/ck"])
    assert text.startswith(f"checkpoint.dir: '{tmp_path}/f' is a file, not a folder (needed to create "
                           f"'{tmp_path}/f/ck')"), text


@pytest.mark.parametrize("pointer,words", [
    ("../../etc", "names '../../etc'; valid: a step_NNNNNN folder inside"),
    ("/tmp/step_000001", "names '/tmp/step_000001'; valid: a step_NNNNNN folder inside"),
    ("step_000007", "names 'step_000007', which is missing or incomplete (no index.json)"),
])
def test_preflight_latest_is_confined_to_its_folder(job, tmp_path, pointer, words):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest").write_text(pointer + "\n")
    text = preflight_problem(job[0] + [f"checkpoint.dir={ck}"])
    assert text.startswith(f"checkpoint.dir: '{ck}/latest' {words}"), text
    assert (ck / "latest").read_text() == pointer + "\n"  # nothing touched


def test_latest_escaping_its_folder_is_refused_at_load_too(tmp_path):
    from verl_hpc.checkpoint.errors import CheckpointNotFoundError
    from verl_hpc.checkpoint.index import resolve

    (tmp_path / "latest").write_text("../elsewhere")
    with pytest.raises(CheckpointNotFoundError, match=r"names '../elsewhere'; it must name a checkpoint folder"):
        resolve(tmp_path)


@pytest.mark.heavy
def test_submit_dry_run_refuses_a_missing_data_file_in_one_line(job, tmp_path):
    missing = tmp_path / "gone.parquet"
    r = subprocess.run([sys.executable, "-m", "verl_hpc.submit", "configs/demo_rl.yaml", "--dry-run",
                        *_set_train(job[0], missing)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == f"error: data.train_files: '{missing}': no such file", r.stderr
    assert not (tmp_path / "logs").exists() and not job[1]["out"].exists()  # nothing created


# ------------------------------------------------------------------ every row, the weights, the tokenizer (issue 28)
def submit_error(capsys, overrides) -> str:
    """`submit --dry-run` in this process: exit 2 and exactly one line on stderr, `error: ...`."""
    from verl_hpc import submit

    code = submit.main(["data.max_prompt_length=64", "data.max_response_length=16", *overrides, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: "), err
    return err.strip()[len("error: "):]


def _jsonl(path, bad_line: bytes, rows: int = 50, at: int = 40):
    good = (json.dumps(ROW) + "\n").encode()
    path.write_bytes(good * (at - 1) + bad_line + b"\n" + good * (rows - at))
    return path


@pytest.mark.parametrize("bad,words", [
    (b'{"prompt": "caf\xe9", "data_source": "gsm8k", "ground_truth": "4"}',
     "data.train_files file '{f}' line 40: byte 0xe9 at column 16 is not UTF-8"),
    (b'{"prompt": "2+2?", "data_source": "gsm8k", "ground_truth": "4"',
     "data.train_files file '{f}' line 40: invalid JSON"),
    (b'{"prompt": "2+2?", "data_source": "gsm8k"}',
     "data.train_files: '{f}' row 39 (line 40): field 'ground_truth' is missing; expected the reference answer"),
    (b'{"prompt": 5, "data_source": "gsm8k", "ground_truth": "4"}',
     "data.train_files: '{f}' row 39 (line 40): field 'prompt' is int 5; expected text or a list of"),
    (b'{"prompt": "2+2?", "data_source": "gsm9k", "ground_truth": "4"}',
     "data.train_files: '{f}' row 39 (line 40): no reward function for data_source 'gsm9k' (did you mean "
     "'gsm8k'?)"),
])
def test_submit_finds_a_bad_jsonl_line_40(job, tmp_path, capsys, bad, words):
    f = _jsonl(tmp_path / "late.jsonl", bad)
    assert submit_error(capsys, _set_train(job[0], f)).startswith(words.format(f=f))


@pytest.mark.parametrize("extra,words", [
    (["data.max_prompt_length=4"], "data.train_files: all 8 prompts are longer than data.max_prompt_length = 4 "
                                   "tokens; nothing is left to train on"),
    (["data.overlong_prompts=error"], "data.train_files sample long.jsonl:5: prompt is "),
])
def test_submit_finds_overlong_prompts_with_the_jobs_tokenizer(job, tmp_path, capsys, extra, words):
    rows = [ROW] * 5 + [dict(ROW, prompt="2 + 2 " * 40)] + [ROW] * 2
    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [o for o in _set_train(job[0], f) if not o.startswith("data.val_files=")]
    assert submit_error(capsys, overrides + extra).startswith(words)


def test_submit_finds_a_null_ground_truth_in_a_late_row_group(job, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(ROW) for _ in range(50)]
    rows[45]["ground_truth"] = None
    f = job[1]["train"]
    pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=10)
    assert pq.ParquetFile(f).num_row_groups == 5
    assert submit_error(capsys, job[0]) == (f"data.train_files: '{f}' row 45: field 'ground_truth' is missing; "
                                            "expected the reference answer as text or a number")


def _edit_config(job, **changes):
    cfg_file = job[1]["model"] / "config.json"
    cfg_file.write_text(json.dumps(dict(json.loads(cfg_file.read_text()), **changes)))
    return cfg_file


@pytest.mark.parametrize("changes,words", [
    (dict(vocab_size=600), "model.path: tensor 'model.embed_tokens.weight' in '{w}' has shape [500, 128]; "
                           "'{c}' (vocab_size=600, hidden_size=128) implies [600, 128] (and 1 more tensors disagree)"),
    (dict(hidden_size=256), "model.path: tensor 'model.embed_tokens.weight' in '{w}' has shape [500, 128]; "
                            "'{c}' (vocab_size=500, hidden_size=256) implies [500, 256] (and "),
    (dict(num_hidden_layers=3), "model.path: '{c}' has num_hidden_layers = 3, the weights hold layers 0..1 "
                                "(2 layers)"),
    (dict(num_hidden_layers=1), "model.path: '{c}' has num_hidden_layers = 1, the weights hold layers 0..1 "
                                "(2 layers) (e.g. 'model.layers.1."),
])
def test_submit_finds_a_config_json_that_disagrees_with_the_weights(job, capsys, changes, words):
    c = _edit_config(job, **changes)
    assert submit_error(capsys, job[0]).startswith(words.format(w=_weights(job), c=c))


def test_submit_finds_a_model_folder_without_a_tokenizer(job, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (job[1]["model"] / name).unlink()
    assert submit_error(capsys, job[0]).startswith(
        f"model.path: '{job[1]['model']}' has no tokenizer files; the job loads its tokenizer from there")


def test_submit_finds_tokenizer_ids_beyond_the_vocabulary(job, capsys):
    f = job[1]["model"] / "tokenizer.json"
    tok = json.loads(f.read_text())
    tok["added_tokens"] += [dict(tok["added_tokens"][-1], id=480 + i, content=f"<|x{i}|>") for i in range(30)]
    f.write_text(json.dumps(tok))
    assert submit_error(capsys, job[0]) == (
        f"model.tokenizer_path: the tokenizer in '{job[1]['model']}' has ids up to 509 (510 tokens with the added "
        f"ones), but '{job[1]['model']}/config.json' has vocab_size = 500; valid: a tokenizer whose ids are all "
        "< vocab_size (the model's own)")


def test_submit_refuses_a_batch_larger_than_the_train_set(job, capsys):
    # 10**12 is refused by the config's range already; a batch within it but past the data set is
    # what only the file check can see
    assert submit_error(capsys, job[0] + ["data.train_batch_size=16"]).startswith(
        "data.train_batch_size: 16 prompts per step, but the train set has 8 prompt(s) after "
        "data.overlong_prompts' filter;")


# ------------------------------------------------------------------ reward functions that misbehave
import math  # noqa: E402
import threading  # noqa: E402

from verl_hpc.rewards import RewardScorer  # noqa: E402
from verl_hpc.rewards.errors import RewardError  # noqa: E402

_release = threading.Event()


def _hangs(ds, text, truth, extra):
    _release.wait()  # "never" returns (released at the end of the test so no thread outlives it)
    return 1.0


def _exits(ds, text, truth, extra):
    raise SystemExit(3)


def _interrupts(ds, text, truth, extra):
    raise KeyboardInterrupt("inside the function")


def _bool(ds, text, truth, extra):
    return True


def _nan_extra(ds, text, truth, extra):
    return {"score": 1.0, "ratio": math.nan, "len": 3}


def _huge(ds, text, truth, extra):
    return 1e39  # finite as a Python float, past float32's range


def _score(fn, on_error="raise", timeout_s=0.5):
    scorer = RewardScorer(on_error, fn, gsm8k_method="strict", timeout_s=timeout_s,
                          custom_name=f"my.rewards:{fn.__name__}")
    return scorer, scorer.score(["train.jsonl:7"], ["gsm8k"], ["42"], ["42"])


@pytest.mark.parametrize("fn,message", [
    (_hangs, "reward function my.rewards:_hangs timed out on sample train.jsonl:7 (data_source 'gsm8k'): did not "
             "return within reward.timeout_s=0.5s (set reward.on_error=zero to score such samples 0 and go on)"),
    (_exits, "reward function my.rewards:_exits failed on sample train.jsonl:7 (data_source 'gsm8k'): raised "
             "SystemExit(3) (a BaseException, which would have ended the rank)"),
    (_interrupts, "reward function my.rewards:_interrupts failed on sample train.jsonl:7 (data_source 'gsm8k'): "
                  "raised KeyboardInterrupt(inside the function)"),
    (_bool, "reward function my.rewards:_bool failed on sample train.jsonl:7 (data_source 'gsm8k'): RewardError: "
            "reward function returned True (a bool); return a number, e.g. 1.0"),
    (_nan_extra, "reward function my.rewards:_nan_extra failed on sample train.jsonl:7 (data_source 'gsm8k'): "
                 "RewardError: reward function returned a non-finite 'ratio' = nan in its dict; every number "
                 "must be finite"),
    (_huge, "reward function my.rewards:_huge failed on sample train.jsonl:7 (data_source 'gsm8k'): RewardError: "
            "reward function returned 1e+39; expected a finite number within float32's range (|score| <= 3.403e+38)"),
])
def test_misbehaving_reward_function_is_one_clear_line(fn, message):
    try:
        with pytest.raises(RewardError) as e:
            _score(fn)
        assert one_line(e.value).startswith(message), e.value
    finally:
        _release.set()


def test_rewards_out_of_range_are_errors_of_the_function_under_on_error_zero():
    returns = [1e39, -1e39, 10 ** 400, math.nan, math.inf, "1.0", None, 0.5, -3.4e38]

    def returns_what_it_is_given(ds, text, truth, extra):
        return returns[int(text)]

    scorer = RewardScorer("zero", returns_what_it_is_given, gsm8k_method="strict", custom_name="m:f")
    n = len(returns)
    scores, metrics = scorer.score([f"a:{i}" for i in range(n)], ["gsm8k"] * n, [str(i) for i in range(n)], ["1"] * n)
    assert scores.tolist() == [0.0] * 7 + [0.5, pytest.approx(-3.4e38)] and metrics["reward/errors"] == 7
    assert scorer.first_error.startswith("sample a:0 (data_source 'gsm8k'):") and "1e+39" in scorer.first_error


@pytest.mark.parametrize("source,line,what", [
    ("x = 1\ndef f(ds, text, truth, extra:\n    return 1.0\n", 2, "SyntaxError: "),
    ("import json\nLIMITS = json.loads('{bad')\n", 2, "JSONDecodeError: Expecting property name"),
    ("def f(ds, text, truth, extra):\n    return 1.0\nraise RuntimeError('no GPU\\nhere')\n", 3,
     "RuntimeError: no GPU here"),
    ("import sys\nsys.exit(3)\n", 2, "SystemExit: 3"),
    ("import not_installed_dep_28\n", 1, "ModuleNotFoundError: No module named 'not_installed_dep_28'"),
], ids=["syntax", "raises", "two-line message", "sys.exit", "missing dependency"])
def test_reward_module_that_fails_at_import_is_one_line_naming_file_and_line(tmp_path, monkeypatch, source, line,
                                                                              what):
    from verl_hpc.config.sections.reward import RewardConfig

    (tmp_path / "broken_rewards_28.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as e:
        RewardScorer.from_config(RewardConfig(custom_function="broken_rewards_28:f"), allow_custom_code=True)
    assert one_line(e.value).startswith(
        f"reward.custom_function = 'broken_rewards_28:f': importing module 'broken_rewards_28' failed at "
        f"{tmp_path / 'broken_rewards_28.py'}, line {line}: {what}"), e.value


def test_timed_out_reward_follows_on_error_zero_and_the_next_call_works():
    _release.clear()
    calls = []

    def first_hangs(ds, text, truth, extra):
        calls.append(text)
        if len(calls) == 1:
            _release.wait()
        return 0.5

    try:
        scorer = RewardScorer("zero", first_hangs, gsm8k_method="strict", timeout_s=0.3, custom_name="m:first_hangs")
        scores, metrics = scorer.score(["a:0", "a:1"], ["gsm8k"] * 2, ["x", "y"], ["1", "1"])
        assert scores.tolist() == [0.0, 0.5] and metrics["reward/errors"] == 1.0
        assert scorer.first_error.startswith("sample a:0 (data_source 'gsm8k'):") and "RewardTimeout" in scorer.first_error
        assert scorer.call.abandoned == 1
    finally:
        _release.set()


# ------------------------------------------------------------------ the stage watchdog
def test_watchdog_names_rank_stage_and_line_of_a_stalled_rank():
    from verl_hpc.runtime.watchdog import StageWatchdog

    dog = StageWatchdog(0.5, rank=3, poll_s=0.1, exit_on_stall=False).start()
    dog.stage("reward")
    end = time.time() + 10
    while dog.stalled is None and time.time() < end:
        time.sleep(0.05)  # the main thread "stalls" here, outside any collective
    dog.stop()
    assert dog.stalled is not None
    import re

    assert re.match(r"rank 3: stalled for \d+s in stage 'reward' outside any collective "
                    r"\(trainer.stage_timeout_s=0.5\); stuck at ", dog.stalled), dog.stalled
    assert __file__ in dog.stalled and "test_watchdog_names_rank_stage_and_line" in dog.stalled


def test_watchdog_does_not_count_time_inside_a_collective(monkeypatch):
    from verl_hpc.runtime import watchdog

    # every frame of this test counts as "inside torch.distributed": waiting for other ranks
    monkeypatch.setattr(watchdog, "_COLLECTIVE_PATHS", (os.path.basename(__file__),))
    dog = watchdog.StageWatchdog(0.3, rank=0, poll_s=0.05, exit_on_stall=False).start()
    dog.stage("sync")
    time.sleep(1.2)
    dog.stop()
    assert dog.stalled is None


def test_watchdog_reads_the_stack_with_the_collector_off(monkeypatch):
    """No collection can start inside sys._current_frames (Python 3.11 holds the thread-list lock
    there: a finalizer that lets go of the GIL deadlocks the process); the collector is on again
    afterwards, and stays off where it was off."""
    import gc
    import threading

    from verl_hpc.runtime import watchdog

    seen = []  # (the reading thread, collector on?): a watchdog left by an earlier test may read too
    real = sys._current_frames

    def spy():
        seen.append((threading.get_ident(), gc.isenabled()))
        return real()

    def mine(ident):
        return [on for who, on in seen if who == ident]

    me = threading.get_ident()
    monkeypatch.setattr(sys, "_current_frames", spy)
    assert gc.isenabled()
    assert watchdog.frame_of(me) is not None
    assert mine(me) == [False] and gc.isenabled()
    gc.disable()
    try:
        watchdog.frame_of(me)
        assert mine(me) == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
    dog = watchdog.StageWatchdog(30, rank=0, poll_s=0.02, exit_on_stall=False).start()
    dog.stage("rollout")
    end = time.time() + 10
    while len(mine(dog._thread.ident)) < 5 and time.time() < end:
        time.sleep(0.02)
    dog.stop()
    reads = mine(dog._thread.ident)
    assert len(reads) >= 5 and not any(reads), seen  # the thread's own reads, each with it off


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen2_moe", "qwen2_moe", layers=2)


@pytest.mark.parametrize("changes,words", [
    (dict(router_jitter_noise="abc"), "{c}: router_jitter_noise='abc' is not implemented; valid: 0 or null"),
    (dict(shared_expert_intermediate_size=0), "{c}: shared_expert_intermediate_size=0: expected a positive integer"),
    (dict(num_experts=2), "tensor 'model.layers.0.mlp.gate.weight' in '{w}' has shape [4, 128]; '{c}' (num_experts=2, "
                          "hidden_size=128) implies [2, 128]"),
])
def test_submit_finds_a_bad_moe_config_json_before_the_queue(job, tiny_moe, capsys, changes, words):
    shutil.rmtree(job[1]["model"])
    shutil.copytree(tiny_moe, job[1]["model"])
    c = _edit_config(job, **changes)
    err = submit_error(capsys, [*job[0], "rollout.engine=hf"])  # one line, before anything is queued
    assert err.startswith("model.path: " + words.format(c=c, w=_weights(job))), err


def test_submit_refuses_a_prm_with_another_tokenizer_or_a_smaller_vocabulary(job, tmp_path, capsys):
    """PRIME's PRM scores the actor's token ids: a PRM folder with another tokenizer (two ids
    swapped), or with no tokenizer and a vocabulary below the actor's ids, is refused naming both
    folders; the actor's own tokenizer beside other weights is accepted."""
    overrides, paths = job
    prm = tmp_path / "prm"
    shutil.copytree(paths["model"], prm)
    prime = [*overrides, "prm.enable=true", f"prm.model_path={prm}", "rollout.engine=hf"]
    assert dry_run_code(capsys, prime) == 0  # the same tokenizer: accepted
    f = prm / "tokenizer.json"
    tok = json.loads(f.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    f.write_text(json.dumps(tok))
    assert submit_error(capsys, prime) == (
        f"prm.model_path: the tokenizer in '{prm}' differs from the actor's in '{paths['model']}' (480 vs 480 tokens; "
        f"token {a!r} is id 100 for the actor and 101 for the PRM); the PRM scores the actor's token ids; valid: a PRM "
        "that shares the actor's tokenizer (prm.model_path, default model.path)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (prm / name).unlink()
    small = _edit_config((None, {"model": prm}), vocab_size=300)
    with pytest.raises(ConfigError) as e:
        preflight(load_config(None, prime))
    weights, vocab = e.value.problems  # the PRM's folder is checked like the actor's: its weights too
    assert weights.startswith(f"prm.model_path: tensor 'model.embed_tokens.weight' in '{prm / 'model.safetensors'}' "
                              "has shape [500, 128]; "), weights
    assert vocab.startswith(f"prm.model_path: the tokenizer in '{paths['model']}' has ids up to 479 (480 tokens with "
                            f"the added ones), but '{small}' has vocab_size = 300; valid: "), vocab


def dry_run_code(capsys, overrides) -> int:
    """`submit --dry-run` in this process; its exit code (stdout and stderr swallowed)."""
    from verl_hpc import submit

    code = submit.main(["data.max_prompt_length=64", "data.max_response_length=16", *overrides, "--dry-run"])
    capsys.readouterr()
    return code
