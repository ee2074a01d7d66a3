"""tracking.alert_webhook: a small JSON body for rollbacks, failures and preemptions, received by a
local HTTP server started here."""
import pytest
from ops_services import webhook_receiver

from verl_hpc.config import JobConfig
from verl_hpc.tracking import Tracker

JOB = JobConfig().slurm.job_name  # the Pushgateway's job label a default config gives


@pytest.fixture
def receiver():
    with webhook_receiver() as (url, got):
        yield url, got


def make(tmp_path, url, is_main=True):
    return Tracker(["jsonl"], tmp_path, 10, "proj", "exp1", None, job_name=JOB, is_main=is_main, plots_enabled=False,
                   namespace="team-a", alert_webhook=url)


def test_rollback_and_preemption_alerts(tmp_path, receiver, monkeypatch):
    url, got = receiver
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    t = make(tmp_path, url)
    t.log({"reward/score/mean": 0.5}, 1)
    t.event("rollback", 6, metric="reward/score/mean", to_step=4)
    t.event("requeue", 6)  # counted in Prometheus, not an alert
    t.close("preempted", 7)
    events = [body for _, body in got]
    assert [e["event"] for e in events] == ["rollback", "preempted"]
    assert all(ct == "application/json" for ct, _ in got)
    rollback = events[0]
    assert rollback["step"] == 6 and rollback["details"] == {"metric": "reward/score/mean", "to_step": 4}
    assert (rollback["namespace"], rollback["experiment"], rollback["project"], rollback["job_id"]) == (
        "team-a", "exp1", "proj", "77")
    assert events[1]["text"] == "verl_hpc: run team-a/exp1 preempted after step 7"


def test_failure_alert_says_why_and_completion_is_quiet(tmp_path, receiver):
    url, got = receiver
    make(tmp_path / "a", url).close("completed", 10)
    assert got == []
    make(tmp_path / "b", url).close("failed", 3, reason="NonFiniteError: step 3: non-finite loss")
    (_, body), = got
    assert body["event"] == "failed" and body["details"]["reason"].startswith("NonFiniteError")
    assert body["text"].endswith("failed after step 3: NonFiniteError: step 3: non-finite loss")
    make(tmp_path / "c", url, is_main=False).close("failed", 3)  # other ranks never send
    assert len(got) == 1


def test_unreachable_webhook_does_not_end_the_run(tmp_path, caplog):
    t = make(tmp_path, "http://127.0.0.1:9/nowhere")
    t.event("rollback", 2)
    t.close("failed", 2)
    assert "alert 'rollback' to http://127.0.0.1:9/nowhere not delivered" in caplog.text
