"""Every command a user runs (`python -m verl_hpc.<x>`, the `verl-hpc-submit` script) answers a bad
input with no traceback: one `error: ...` line and the exit code of its error class (docs/errors.md:
2 config or option, 10 data, 21/22 checkpoint), or argparse's usage line and 2; Ctrl-C in the config
and checkpoint commands is one line and 130, as in submit and plan (docs/signals.md).

The walk calls each command's `main(argv)` in this process (a subprocess spends seconds on its
imports); a few real processes check what only a process shows: the exit status and a signal."""
import dataclasses
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.config_mapping import parse_hf_config

REPO = Path(__file__).resolve().parents[2]
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 500, "intermediate_size": 128}
RL_OK = ["data.train_files=[t.parquet]", "rollout.n=2"]  # what validate asks of an RL config without files

# module, argv, exit code, words of the last stderr line. {tmp}: a new folder; {file}: a plain file
# (a path under it cannot be created); {bad_model}: a model folder whose config.json has a string
# rms_norm_eps; {json_model}: a folder holding only a valid config.json; {damaged}: a checkpoint
# folder whose index.json is not JSON.
WALK = [
    ("verl_hpc.submit", ["{tmp}/nope.yaml", "--dry-run"], 2, "error: config file not found: '{tmp}/nope.yaml'"),
    ("verl_hpc.submit", ["trainer.total_steps=ten", "--dry-run"], 2, "error: trainer.total_steps: expected int"),
    ("verl_hpc.submit", ["--join", "{tmp}/norun", "--local"], 30,
     "error: {tmp}/norun has no elastic/rendezvous.json: it is not an elastic run"),
    ("verl_hpc.submit", ["--join", "{tmp}/norun", "--workers", "0"], 2, "error: --workers = 0: must be >= 1"),
    ("verl_hpc.plan", ["--suggest", "--top", "-1"], 2,
     "error: --top: got -1; valid: how many layouts --suggest shows, >= 1"),
    ("verl_hpc.plan", ["model.path={bad_model}", *RL_OK], 2,
     "error: {bad_model}/config.json: rms_norm_eps='1e-6': expected a number > 0"),
    ("verl_hpc.config", ["trainer.total_steps=ten"], 2, "error: trainer.total_steps: expected int"),
    ("verl_hpc.job", ["{tmp}/nope.yaml"], 2, "error: config file not found"),
    ("verl_hpc.checkpoint", ["inspect", "{damaged}"], 22, "error: {damaged}/index.json is not valid JSON"),
    ("verl_hpc.checkpoint", ["export", "{damaged}", "--hf", "{tmp}/out", "--shard-gb", "-1"], 2,
     "error: --shard-gb: got -1.0; valid: a number of GB > 0"),
    ("verl_hpc.data.prepare", ["gsm8k", "{tmp}/nope.jsonl", "{tmp}/out.parquet"], 10,
     "error: gsm8k input '{tmp}/nope.jsonl': no such file"),
    ("verl_hpc.data.prepare", ["synthetic", "{tmp}/data", "--sft-noise", "2"], 2,
     "error: --sft-noise: a fraction in [0, 1], got 2.0"),
    ("verl_hpc.data.prepare", ["synthetic", "{file}/data", "--n-train", "4", "--n-val", "2"], 2,
     "error: cannot write '{file}/data/train.parquet': Not a directory"),
    ("verl_hpc.models.tiny", ["{tmp}/model", "--layers", "0"], 2, "error: --layers: got 0; valid: a count >= 1"),
    ("verl_hpc.models.tiny", ["{file}/model"], 2, "error: OUT '{file}/model': cannot write the model there"),
    ("verl_hpc.models.tiny_vlm", ["{tmp}/model", "--layers", "0"], 2, "error: --layers: got 0; valid: a count >= 1"),
    ("verl_hpc.models.tiny_vlm", ["{file}/model"], 2, "error: OUT '{file}/model': cannot write the model there"),
    ("verl_hpc.gpu_check", ["--only", "no_such_check"], 2, "argument --only: invalid choice: 'no_such_check'"),
    ("verl_hpc.gpu_check", ["--out", "{file}", "--dry-run"], 2, "error: --out '{file}' is a file"),
    ("verl_hpc.gpu_check.all", ["--out", "{file}", "--dry-run"], 2, "error: --out '{file}' is a file"),
    ("verl_hpc.gpu_check.wheels", ["{tmp}/wheels", "--glibc", "2"], 2, "error: --glibc: got '2'; valid: X.Y"),
    ("verl_hpc.gpu_check.wheels", ["{file}"], 2, "error: OUT '{file}' is a file"),
    ("verl_hpc.gpu_check.vllm_kit", ["{file}"], 2, "error: OUT '{file}' is a file"),
    ("verl_hpc.gpu_check.vllm_kit", ["{tmp}/kit", "--piece-mib", "0"], 2,
     "error: --piece-mib 0; valid: more than 0, at most 60"),
    ("verl_hpc.gpu_check.vllm_pieces", ["verify", "{tmp}/none"], 1,
     "vllm kit: {tmp}/none/MANIFEST.json: no manifest"),
    ("verl_hpc.gpu_check.image", ["prefix", "{file}/env"], 1, "image: {file}/env: cannot make the prefix there"),
    ("verl_hpc.gpu_check.wheels", ["{tmp}/wheels", "--image", "{file}"], 1,
     "wheels: --image {file}, line 1: 'a plain file'; valid: name==version lines"),
    ("verl_hpc.trainer.programs.demo", ["--ranks", "0"], 2, "error: --ranks: got 0"),
    ("verl_hpc.trainer.programs.demo", ["--rl-config", "{tmp}/nope.yaml"], 2, "error: --rl-config: no such config file"),
    ("verl_hpc.trainer.programs.demo_distill", ["--student-layers", "0"], 2,
     "error: --teacher-steps and --student-layers: got 60 and 0; valid: >= 1"),
    ("verl_hpc.trainer.programs.demo_judge", ["{tmp}/nope"], 2, "error: OUT '{tmp}/nope': no data/train.parquet"),
    ("verl_hpc.trainer.programs.greedy_eval", ["{tmp}/nope", "{tmp}/val.parquet"], 2,
     "error: MODEL_DIR: no such folder '{tmp}/nope'"),
    ("verl_hpc.trainer.programs.greedy_eval", ["{json_model}", "{tmp}/val.parquet"], 10,
     "error: val file '{tmp}/val.parquet': no such file"),
]
# modules with a `__main__` that a user does not run: started by the project itself
NOT_COMMANDS = {
    "verl_hpc.gpu_check.multi_gpu": "one rank of the kit's two-rank check, started by gpu_check",
    "verl_hpc.gpu_check.cp_check": "one rank of the kit's context-parallel check, started by gpu_check",
    "verl_hpc.rollout.tools.sandbox_inner": "the sandbox's inner process, started by the sandbox",
    "verl_hpc.rollout.vllm.probe": "the vLLM support check's subprocess (vLLM imported apart), started by the check",
    "verl_hpc.rollout.vllm.quant_probe": "rollout.quantization's probe subprocess (tiny engines per method), "
                                         "started by the check",
    "verl_hpc.gpu_check.vllm_kit_probe": "the vLLM kit's import probe, started by its install step",
    "verl_hpc.launcher.restart_loop": "the in-allocation restart's supervisor, run by the job's batch script around "
                                      "srun (its options are the script writers'; tests/unit/test_restart_loop.py)",
}


def commands():
    """Every module `python -m` runs as a program: a `__main__.py` (its package) or a module with
    an `if __name__ == "__main__":` block."""
    found = set()
    for path in (REPO / "verl_hpc").rglob("*.py"):
        if path.name == "__main__.py" or re.search(r'^if __name__ == "__main__":', path.read_text(), re.M):
            parts = path.relative_to(REPO).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


def test_the_walk_covers_every_command():
    assert commands() == {m for m, *_ in WALK} | set(NOT_COMMANDS)
    setup = (REPO / "setup.py").read_text()
    assert re.findall(r'"[\w-]+=(verl_hpc[\w.]*):main"', setup) == ["verl_hpc.submit"]  # the console script


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "file").write_text("a plain file\n")
    for name, config in (("bad_model", {**LLAMA, "rms_norm_eps": "1e-6"}), ("json_model", LLAMA)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "damaged").mkdir()
    (root / "damaged" / "index.json").write_text('{"format": ')
    return {"file": str(root / "file"), "bad_model": str(root / "bad_model"),
            "json_model": str(root / "json_model"), "damaged": str(root / "damaged")}


def call(module: str, argv, capsys):
    """(exit code, stdout, stderr) of `python -m module *argv`, run in this process."""
    loaded = importlib.import_module(module)
    if not hasattr(loaded, "main"):  # a package: its __main__ module
        loaded = importlib.import_module(f"{module}.__main__")
    try:
        code = loaded.main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("module, argv, code, words", WALK,
                         ids=[f"{m.removeprefix('verl_hpc.')}-{i}" for i, (m, *_) in enumerate(WALK)])
def test_a_bad_input_is_one_line_and_its_class_code(module, argv, code, words, paths, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    fill = {"tmp": str(tmp_path), **paths}
    got, _, err = call(module, [a.format(**fill) for a in argv], capsys)
    assert "Traceback" not in err, err
    assert got == code, (got, err)
    lines = err.strip().splitlines()
    assert words.format(**fill) in lines[-1], err
    assert len(lines) == 1 or lines[0].startswith("usage:"), err  # one line, or argparse's usage and its line


@pytest.mark.parametrize("field, value, words", [
    ("rms_norm_eps", "1e-6", "rms_norm_eps='1e-6': expected a number > 0"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06: expected a number > 0"),
    ("rope_theta", True, "rope_theta=True: expected a number > 0"),
    ("rope_theta", "10000", "rope_theta='10000': expected a number > 0"),
    ("partial_rotary_factor", "1", "partial_rotary_factor='1': expected a number > 0"),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}, "rope_scaling.factor='2': expected a number > 0"),
    ("rope_scaling", "linear", "rope_scaling='linear': expected an object"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false': expected true or false"),
])
def test_dense_config_json_fields_of_the_wrong_type_name_the_field(field, value, words):
    """Before: float() of a string raised a bare ValueError on the rank, and bool("false") tied the
    embeddings; now the submitter's check (and the plan) names the file and the field."""
    with pytest.raises(ConfigError) as e:
        parse_hf_config({**LLAMA, field: value}, "m/config.json")
    assert str(e.value).startswith(f"m/config.json: {words}"), e.value


def test_dense_config_json_nulls_take_the_defaults():
    arch = parse_hf_config({**LLAMA, "rms_norm_eps": None, "rope_theta": None, "tie_word_embeddings": None})
    assert (arch.rms_norm_eps, arch.rope_theta, arch.tie_word_embeddings) == (1e-6, 10000.0, False)


# ------------------------------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_in_the_config_command_is_one_line_and_130(monkeypatch, capsys):
    from verl_hpc.config import __main__ as config_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(config_cli, "load_config", interrupted)
    assert config_cli.main(["configs/smoke.yaml"]) == 130
    assert capsys.readouterr().err == "[config] stopped by SIGINT before the config was checked\n"


@pytest.mark.parametrize("command", ["verify", "export"])
def test_ctrl_c_in_the_checkpoint_command_is_one_line_and_130(command, monkeypatch, tmp_path, capsys):
    from verl_hpc.checkpoint import __main__ as ckpt_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(ckpt_cli.SUBCOMMANDS, command, dataclasses.replace(ckpt_cli.SUBCOMMANDS[command], run=interrupted))
    assert ckpt_cli.main([command, str(tmp_path)]) == 130
    tail = "; the export is not complete: run it again" if command == "export" else ""
    assert capsys.readouterr().err == f"[checkpoint] stopped by SIGINT during {command}{tail}\n"


def reading(pipe: Path, *command):
    """`python -m *command` in a session of its own, once it has opened the named pipe `pipe` to
    read (a known moment: its imports are done); returns (process, the pipe's write end)."""
    os.mkfifo(pipe)
    proc = subprocess.Popen([sys.executable, "-m", *command], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:  # fails (ENXIO) until the program has opened the pipe
            return proc, os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{command} never opened {pipe}: {proc.communicate()}") from None
            time.sleep(0.05)


@pytest.mark.parametrize("command, line", [
    (("verl_hpc.config", "{pipe}"), "[config] stopped by SIGINT before the config was checked\n"),
    (("verl_hpc.checkpoint", "inspect", "{folder}"), "[checkpoint] stopped by SIGINT during inspect\n"),
], ids=["config", "checkpoint"])
@pytest.mark.heavy
def test_ctrl_c_in_a_real_process(terminal_sigint, tmp_path, command, line):
    """A terminal's Ctrl-C while the command reads its input (the config; the checkpoint's index)."""
    folder = tmp_path / "step_000001"
    folder.mkdir()
    pipe = folder / ("job.yaml" if command[0] == "verl_hpc.config" else "index.json")
    proc, end = reading(pipe, *[c.format(pipe=pipe, folder=folder) for c in command])
    try:
        os.killpg(proc.pid, signal.SIGINT)  # the terminal signals the foreground process group
        time.sleep(0.2)  # a thread other than the main one may take the signal: the read's end runs it
        os.close(end)
        end = None
        _, err = proc.communicate(timeout=60)
    finally:
        if end is not None:
            os.close(end)
        proc.kill()
    assert (proc.returncode, err) == (130, line)


@pytest.mark.heavy
def test_a_real_process_exits_with_the_code_and_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "verl_hpc.data.prepare", "synthetic", str(tmp_path / "d"),
                          "--n-train", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (2, "error: --n-train and --n-val: must be > 0, got 0 and 200\n")
