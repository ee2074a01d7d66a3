"""The Tracker facade: rank 0 only, fan-out, failure isolation, plots at close, resume."""
import json
import math

import pytest
import torch

from verl_hpc.config import JobConfig
from verl_hpc.tracking import BACKENDS, Tracker, missing_packages, read_history

JOB = JobConfig().slurm.job_name  # the Pushgateway's job label a default config gives


def metrics(step):
    return {"reward/mean": 0.1 * step, "actor/kl": 0.01, "actor/entropy": 1.0,
            "response_length/mean": 20.0 + step}


def test_other_ranks_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    tracker = Tracker(list(BACKENDS[:3]), out, 5, "p", "e", {"a": 1}, job_name=JOB, is_main=False)
    for step in range(1, 6):
        tracker.log(metrics(step), step)
    assert tracker.truncate_from(1) == 0
    assert tracker.close() is None
    assert not out.exists() and capsys.readouterr().out == ""
    assert tracker.backends == []


def test_main_rank_end_to_end(tmp_path, capsys):
    tracker = Tracker(["console", "jsonl"], tmp_path, 4, "proj", "exp", None, job_name=JOB, is_main=True)
    for step in range(1, 5):
        m = metrics(step)
        m["actor/pg_loss"] = torch.tensor(0.5)   # 0-d tensors are fine
        m["bad/vector"] = torch.ones(3)          # not a scalar: dropped with a warning
        m["bad/str"] = "oops"
        if step == 2:
            m["actor/kl"] = math.inf
        tracker.log(m, step)
    path = tracker.close()
    assert tracker.close() == path  # idempotent
    assert path == tmp_path / "plots" / "training_curves.png" and path.is_file()
    out = capsys.readouterr().out
    assert "step 4/4 (100%)" in out and f"plots: {path}" in out
    rows = read_history(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["actor/pg_loss"] == 0.5 and "bad/vector" not in rows[0]
    assert math.isnan(rows[1]["actor/kl"])  # written as null, read back as a gap
    line2 = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert line2["nonfinite"] == ["actor/kl"]


def test_reserved_name_dropped_not_clobbering_step(tmp_path):
    tracker = Tracker(["jsonl"], tmp_path, 1, "p", "e", None, job_name=JOB, is_main=True, plots_enabled=False)
    tracker.log({"step": 99.0, "time": 1.0, "reward/mean": 1.0}, 1)
    tracker.close()
    (row,) = read_history(tmp_path / "metrics.jsonl")
    assert row["step"] == 1 and row["time"] > 1e9


def test_plots_without_jsonl_use_memory(tmp_path):
    tracker = Tracker(["console"], tmp_path, 3, "p", "e", None, job_name=JOB, is_main=True, tty=False)
    for step in range(1, 4):
        tracker.log(metrics(step), step)
    assert tracker.close().is_file()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_start_step_and_facade_truncate(tmp_path):
    first = Tracker(["jsonl"], tmp_path, 10, "p", "e", None, job_name=JOB, is_main=True, plots_enabled=False)
    for step in range(1, 7):
        first.log(metrics(step), step)
    first.close()
    second = Tracker(["jsonl"], tmp_path, 10, "p", "e", None, job_name=JOB, is_main=True, start_step=4,
                     plots_enabled=False)
    assert [r["step"] for r in read_history(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    second.log(metrics(4), 4)
    assert second.truncate_from(2) == 3  # steps 2, 3 and the new 4
    second.close()
    assert [r["step"] for r in read_history(tmp_path / "metrics.jsonl")] == [1]


class Exploding:
    def __init__(self):
        self.calls = self.closed = 0

    def log(self, metrics, step):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        self.closed += 1


def test_failing_backend_is_dropped_and_others_go_on(tmp_path, caplog):
    tracker = Tracker(["jsonl"], tmp_path, 10, "p", "e", None, job_name=JOB, is_main=True, plots_enabled=False)
    bad = Exploding()
    tracker._backends["broken"] = bad
    for step in range(1, 6):
        tracker.log(metrics(step), step)
    tracker.close()
    assert bad.calls == 3 and bad.closed == 1 and tracker.backends == ["jsonl"]
    assert "dropping backend broken" in caplog.text
    assert len(read_history(tmp_path / "metrics.jsonl")) == 5


def test_unknown_backend_and_missing_packages(tmp_path):
    with pytest.raises(ValueError, match="tracking.backends.*valid: console, jsonl"):
        Tracker(["console", "neptune"], tmp_path, 1, "p", "e", None, job_name=JOB, is_main=True)
    problems = missing_packages(["console", "wandb", "mlflow"])
    assert len(problems) == 2 and all("tracking.backends" in p for p in problems)


def test_async_run_jsonl_keeps_bucket_scalars_console_summarises_them(tmp_path, capsys, caplog):
    caplog.set_level("INFO", logger="verl_hpc.tracking.tracker")
    tracker = Tracker(["console", "jsonl"], tmp_path, 2, "p", "e", None, job_name=JOB, is_main=True)
    for step in (1, 2):
        tracker.log({**metrics(step), "async/staleness/hist/0": 30.0, "async/staleness/hist/1": 10.0,
                     "async/staleness_mean": 0.25, "async/staleness_max": 1.0,
                     "async/idle_frac/rollout": 0.4, "async/idle_frac/train": 0.1}, step)
    tracker.close()
    rows = read_history(tmp_path / "metrics.jsonl")
    assert [(r["async/staleness/hist/0"], r["async/staleness/hist/1"]) for r in rows] == [(30.0, 10.0)] * 2
    out = capsys.readouterr().out
    assert out.count("async/staleness/hist  n=40  mean=0.25  max=1  | 0:30 1:10") == 2
    assert "Asynchronous training" in caplog.text  # the plot's panels, logged at close
