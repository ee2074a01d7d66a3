"""The Slurm submitter's status line carries the step progress (issue 11 item 6): read from the
trainer's metrics.jsonl, with the rate over the last steps' own timestamps."""
import json

from verl_hpc.launcher.slurm import MetricsProgress


def _rows(path, steps, t0=1000.0, dt=2.5):
    with open(path, "a") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "time": t0 + dt * s, "reward/score/mean": 0.1}) + "\n")


def test_progress_line_from_metrics_jsonl(tmp_path):
    f = tmp_path / "metrics.jsonl"
    progress = MetricsProgress(f, total_steps=100)
    assert progress() == ""  # no file yet
    _rows(f, [1])
    assert progress() == "step 1/100 (1%) ? s/step ETA ?"
    _rows(f, range(2, 11))
    assert progress() == "step 10/100 (10%) 2.5 s/step ETA 3m45s"
    with open(f, "a") as fh:
        fh.write('{"step": 11, "ti')  # a line being written is not read yet
    assert progress() == "step 10/100 (10%) 2.5 s/step ETA 3m45s"


def test_progress_after_a_resume_rewrote_the_file(tmp_path):
    f = tmp_path / "metrics.jsonl"
    progress = MetricsProgress(f, total_steps=20)
    _rows(f, range(1, 9))
    assert progress().startswith("step 8/20")
    f.write_text("")  # the requeued attempt truncates to its checkpoint, then appends
    _rows(f, range(1, 6), dt=1.0)
    assert progress() == "step 5/20 (25%) 1.0 s/step ETA 15s"


def test_an_elastic_run_shows_its_rollout_pool(tmp_path):
    f = tmp_path / "metrics.jsonl"
    progress = MetricsProgress(f, total_steps=10)
    with open(f, "a") as fh:
        for s, (pool, joins) in enumerate([(0, 0), (2, 2), (1, 3)], start=1):
            fh.write(json.dumps({"step": s, "time": 1000.0 + s, "elastic/pool_size": pool, "elastic/joins": joins}) + "\n")
    assert progress() == "step 3/10 (30%) 1.0 s/step ETA 7s; rollout pool 1 worker(s) (3 joined so far)"
