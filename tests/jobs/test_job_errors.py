"""Job-time errors (issue 11): a bad input found inside a rank ends it with one `error: ...` line
and its class's exit code (verl_hpc/runtime/errors.py), never a traceback. The rank's own entry
(`verl_hpc.job.main`) runs in the test process (tests/jobs.py), except where the error is what the
interpreter prints at exit."""
import json
import os
import struct
import subprocess
import sys

import pytest

from jobs import REPO, data_overrides, run_here


def run_rank(tmp_path, root, *overrides):
    proc, _ = run_here("configs/demo_rl.yaml", tmp_path / "out", f"model.path={root}/model", *data_overrides(root),
                       "rollout.engine=hf", "trainer.total_steps=1", "data.train_batch_size=4", "rollout.n=2",
                       "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=4", "trainer.val_every=0",
                       "tracking.backends=[jsonl]", "tracking.plots=false", *overrides)
    return proc


def check_one_line(proc, code, *words):
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == code and len(errors) == 1, proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


@pytest.mark.check
def test_bad_data_row_at_job_time_is_one_line(tmp_path, tiny_assets):
    root = tiny_assets
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?", "data_source": "synthetic", "ground_truth": "2"}) + "\n"
                   + json.dumps({"prompt": "2+2?", "data_source": "synthetic"}) + "\n")
    proc = run_rank(tmp_path, root, f"data.train_files=[{bad}]", "data.val_files=[]")
    check_one_line(proc, 10, str(bad), "line 2", "ground_truth")


def test_truncated_weights_at_job_time_name_the_file(tmp_path, tiny_assets):
    root = tiny_assets
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(root / "model"), str(model)], check=True)
    weights = sorted(model.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:-64])
    proc = run_rank(tmp_path, root, f"model.path={model}")
    check_one_line(proc, 13, f"'{weights}'", "truncated")


def test_corrupt_checkpoint_at_resume_is_one_line(tmp_path, tiny_assets):
    root = tiny_assets
    ck = tmp_path / "ck"
    (ck / "step_000001").mkdir(parents=True)
    (ck / "step_000001" / "index.json").write_text("{not json")
    (ck / "latest").write_text("step_000001\n")
    before = sorted((p.name, p.read_bytes()) for p in ck.rglob("*") if p.is_file())
    proc = run_rank(tmp_path, root, f"checkpoint.dir={ck}")
    check_one_line(proc, 22, "index.json is not valid JSON")  # CheckpointCorruptError
    assert sorted((p.name, p.read_bytes()) for p in ck.rglob("*") if p.is_file()) == before  # untouched


def damage_tensor_bytes(path):
    """Move the boundary between the file's first two tensors by 4 bytes: the header stays valid
    JSON, its shapes stay those config.json implies and the data still ends at the end of the file
    (so the header check every rank makes first passes), but the two tensors' byte counts no
    longer match their shapes, which safetensors refuses when the critic's weights are opened."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    header[first]["data_offsets"][1] -= 4
    header[second]["data_offsets"][0] -= 4
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n, "the edited header must fit the old one's length"
    path.write_bytes(raw[:8] + text.ljust(n, b" ") + raw[8 + n:])


# the roles' case in make test-long (a second job with vLLM built, the same last-line path): make test
# keeps the trainer's
@pytest.mark.parametrize("stage", [pytest.param("building the roles", marks=pytest.mark.long), "building the trainer"])
def test_error_after_vllm_is_built_is_the_last_line(tmp_path, tiny_assets, stage):
    """An error raised after the vLLM engine came up (a critic's damaged weights while the roles are
    built; a reward module that cannot be imported while the trainer is built) ends the rank with
    its one line and nothing after it: an engine left open was shut down by vLLM's exit-time
    finalizer after the process group was gone ("Invalid process group specified"). A real
    process, since that finalizer runs only when the interpreter exits."""
    root = tiny_assets
    if stage == "building the roles":
        critic = tmp_path / "critic"
        subprocess.run(["cp", "-r", str(root / "model"), str(critic)], check=True)
        damage_tensor_bytes(sorted(critic.glob("*.safetensors"))[0])
        extra, code = ["algorithm.adv_estimator=gae", "critic.enable=true", f"critic.model_path={critic}",
                       "critic.ppo_mini_batch_size=2", "critic.micro_batch_size=4"], 13
    else:
        extra, code = ["reward.custom_function=no_such_reward_module:score", "safety.allow_custom_code=true"], 11
    cmd = [sys.executable, "-m", "verl_hpc.job", "configs/demo_rl.yaml", f"trainer.output_dir={tmp_path}/out",
           "slurm.tasks_per_node=1", f"model.path={root}/model", *data_overrides(root), "rollout.engine=vllm",
           "trainer.total_steps=1", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
           "actor.micro_batch_size=4", "trainer.val_every=0", "tracking.backends=[jsonl]",
           "tracking.plots=false", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "vLLM engine up" in proc.stderr, proc.stderr[-5000:]  # the error came after the engine
    check_one_line(proc, code)
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: "), proc.stderr[-5000:]


def test_weights_that_disagree_with_config_json_stop_the_rank_before_any_engine(tmp_path, tiny_assets):
    """A rank started without submit's file checks (an sbatch script by hand) checks the
    safetensors headers against config.json itself, instead of failing in a weight loader."""
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(tiny_assets / "model"), str(model)], check=True)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, vocab_size=config["vocab_size"] + 64)))
    proc = run_rank(tmp_path, tiny_assets, f"model.path={model}")
    check_one_line(proc, 13, "model.path", "embed_tokens", "vocab_size", "implies")


def multi_turn_start_up_failures(tmp_path, root):
    """{case: (overrides, exit code, words of the error line)}: a multi-turn job whose tools,
    environment or chat template cannot be used, with user code in tmp_path/code."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "clash_tools.py").write_text('def calculator(expression: str) -> str:\n    """Also a calculator.\n\n'
                                         '    Args:\n        expression: The sum.\n    """\n    return expression\n')
    (code / "clash_env.py").write_text("def Game():\n    return None\n\n\nclass Sized:\n"
                                       "    def __init__(self, size):\n        pass\n\n    def reset(self, row):\n"
                                       "        pass\n\n    def step(self, turn_text):\n        return None, 0.0, True\n")
    bare = tmp_path / "no_template"  # the tiny tokenizer without its chat template
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((root / "model" / name).read_bytes())
    (tmp_path / "a_file").write_text("")
    user = ["safety.allow_custom_code=true"]
    return {
        "user tool not on the path": (["multi_turn.user_tools=[no_such_tool_module:fn]", *user], 2,
                                      ["no_such_tool_module", "PYTHONPATH"]),
        "two tools of one name": (["multi_turn.user_tools=[clash_tools:calculator]", *user], 2,
                                  ["two tools are named 'calculator'"]),
        "environment not a class": (["multi_turn.environment=clash_env:Game", *user], 2, ["it is not a class"]),
        "environment needs an argument": (["multi_turn.environment=clash_env:Sized", *user], 2,
                                          ["cannot be called as Sized()", "'size'"]),
        "no chat template": ([f"model.tokenizer_path={bare}"], 10, ["needs a tokenizer with a chat_template"]),
        "scratch root not a folder": (["multi_turn.tools=[python]", f"sandbox.scratch_root={tmp_path}/a_file"], 2,
                                      ["sandbox.scratch_root", "not a writable folder"]),
    }


MULTI_TURN = ["multi_turn.enable=true", "data.max_response_length=64", "rollout.max_tokens=16", "rollout.engine=vllm"]


@pytest.mark.parametrize("case", ["two tools of one name", "environment not a class", "environment needs an argument",
                                  "no chat template", "scratch root not a folder"])
def test_a_multi_turn_job_that_cannot_start_stops_before_any_engine(tmp_path, tiny_assets, monkeypatch, case):
    """What multi_turn needs (the chat template, the tools, the environment, the sandbox) is built
    first: the job stops in seconds with its one line, and no vLLM engine was started, whose
    exit-time finalizer printed a traceback after that line."""
    overrides, code, words = multi_turn_start_up_failures(tmp_path, tiny_assets)[case]
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    proc = run_rank(tmp_path, tiny_assets, *MULTI_TURN, *overrides)
    check_one_line(proc, code, *words)
    assert "vLLM engine up" not in proc.stderr, proc.stderr[-5000:]


def test_a_multi_turn_start_up_error_is_the_last_line_of_a_real_rank(tmp_path, tiny_assets):
    """The same in a real process, where vLLM's exit path runs (tests/jobs.py cannot show it)."""
    overrides, code, words = multi_turn_start_up_failures(tmp_path, tiny_assets)["user tool not on the path"]
    cmd = [sys.executable, "-m", "verl_hpc.job", "configs/demo_rl.yaml", f"trainer.output_dir={tmp_path}/out",
           "slurm.tasks_per_node=1", f"model.path={tiny_assets}/model", *data_overrides(tiny_assets),
           "trainer.total_steps=1", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
           "actor.micro_batch_size=4", *MULTI_TURN, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    check_one_line(proc, code, *words)
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: "), proc.stderr[-5000:]
    assert "vLLM engine up" not in proc.stderr, proc.stderr[-5000:]


@pytest.mark.parametrize("every", [0, 2])
def test_a_rollout_serving_other_weights_stops_the_job_naming_the_tensor(tmp_path, tiny_assets, every):
    """The served-weights check (resharding.check_served, on by default): the vLLM engine loads one
    tensor with other values than the sync sent it. At the first sync (every = 0: only there) or, when
    the fault starts at the second sync, at the second (every = 2: the first and every second sync are
    read back), the job stops with the weight sync's exit code and one line naming that tensor."""
    import faults

    name = "model.layers.1.mlp.down_proj.weight"
    steps = "1" if every == 0 else "3"
    with faults.injected(rollout_serves_other_values=name if every == 0 else f"{name}@2"):
        proc = run_rank(tmp_path, tiny_assets, "rollout.engine=vllm", "rollout.kv_cache_memory_bytes=33554432",
                        f"resharding.check_served_every={every}", f"trainer.total_steps={steps}")
    line = check_one_line(proc, 15, name, "serves other values", "model.layers.1.mlp.down_proj")
    assert "weight sync failed on rank 0" in line, line
