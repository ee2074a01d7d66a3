"""Job-time errors (issue 11): a bad input found inside a rank ends it with one `error: ...` line
and its class's exit code (verl_hpc/runtime/errors.py), never a traceback. The rank's own entry
(`verl_hpc.job.main`) runs in the test process (tests/jobs.py)."""
import json
import subprocess

import pytest

from jobs import data_overrides, run_here


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
