"""Prometheus for batch jobs, against a real Pushgateway (the Debian `prometheus-pushgateway`,
installed by slurm/devcluster/start.sh, which `make test` runs) started here on 127.0.0.1.

What was pushed is read back over the gateway's HTTP API: the labelled group, gauges of the last
values, the rollout-latency and stage histograms (with a P95 computed the way PromQL's
histogram_quantile does), the counters, the outcome at exit, and delete-on-finish.
"""
import logging
import socket
import time

import pytest
from ops_services import families, free_port, get, groups, pushgateway, samples

from verl_hpc.config import JobConfig
from verl_hpc.tracking import Tracker

JOB = JobConfig().slurm.job_name  # the Pushgateway's job label a default config gives


@pytest.fixture
def gateway(tmp_path):
    with pushgateway(tmp_path) as url:
        yield url


def histogram_quantile(q, buckets):
    """PromQL's histogram_quantile: linear interpolation inside the bucket holding rank q*count."""
    buckets = sorted(buckets, key=lambda b: b[0])
    total, rank = buckets[-1][1], q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def tracker(tmp_path, url, **kw):
    return Tracker(["prometheus"], tmp_path, 20, "proj", "exp1", None, is_main=True, plots_enabled=False,
                   namespace="team-a", pushgateway_url=url, job_name="team-a-verl_hpc", **kw)


def test_labelled_series_histograms_and_counters_read_back(tmp_path, gateway):
    t = tracker(tmp_path, gateway)
    latencies = [0.03] * 10 + [0.3] * 8 + [3.0] * 2  # 20 request batches; the P95 sits in (2.5, 5]
    for step, lat in enumerate(latencies, start=1):
        t.log({"reward/score/mean": step / 20, "rollout/seconds": lat, "timing_s/generate": lat,
               "timing_s/update_actor": 0.2, "timing_s/step": lat + 0.2,
               "actor/nonfinite_steps": 1.0 if step in (4, 9) else 0.0}, step)
        if step == 5:  # what a live scrape of the gateway sees mid-run
            mid = families(gateway)
            assert samples(mid["verl_hpc_step"], namespace="team-a")[0].value == 5
    t.event("rollback", 12, metric="reward/score/mean")
    t.close("completed", 20)

    pushed = groups(gateway)
    assert len(pushed) == 1
    labels = pushed[0]["labels"]
    assert labels["job"] == "team-a-verl_hpc" and labels["namespace"] == "team-a"
    assert labels["experiment"] == "exp1" and labels["instance"].startswith(socket.gethostname() + ":")

    fam = families(gateway)
    group = dict(job="team-a-verl_hpc", namespace="team-a", experiment="exp1")
    assert samples(fam["verl_hpc_reward_score_mean"], **group)[0].value == 1.0  # the last step's
    assert samples(fam["verl_hpc_step"], **group)[0].value == 20
    lat = fam["verl_hpc_rollout_latency_seconds"]
    buckets = [(float(s.labels["le"]), s.value) for s in samples(lat, **group) if s.name.endswith("_bucket")]
    assert dict(buckets)[0.05] == 10 and dict(buckets)[0.5] == 18 and dict(buckets)[float("inf")] == 20
    assert [s.value for s in samples(lat, **group) if s.name.endswith("_count")] == [20]
    p95 = histogram_quantile(0.95, buckets)
    assert 2.5 < p95 <= 5.0, p95
    stages = fam["verl_hpc_stage_seconds"]
    counts = {s.labels["stage"]: s.value for s in samples(stages, **group) if s.name.endswith("_count")}
    assert counts == {"generate": 20, "update_actor": 20, "step": 20}
    assert samples(fam["verl_hpc_nonfinite_skipped_steps"], **group)[0].value == 2
    assert samples(fam["verl_hpc_rollbacks"], **group)[0].value == 1
    assert samples(fam["verl_hpc_preemptions"], **group)[0].value == 0
    outcome = {s.labels["outcome"]: s.value for s in samples(fam["verl_hpc_run_outcome"], **group)}
    assert outcome == {"running": 0, "completed": 1, "failed": 0, "preempted": 0}


def test_failure_and_preemption_stay_visible_completion_can_be_deleted(tmp_path, gateway, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # this attempt is the job's second requeue
    t = tracker(tmp_path, gateway, pushgateway_delete_on_finish=True)
    t.log({"reward/score/mean": 0.5}, 1)
    t.close("preempted", 1)
    fam = families(gateway)
    me = dict(instance=f"{socket.gethostname()}:4242", namespace="team-a")
    assert samples(fam["verl_hpc_preemptions"], **me)[0].value == 1
    assert samples(fam["verl_hpc_requeues"], **me)[0].value == 2
    assert samples(fam["verl_hpc_run_outcome"], outcome="preempted", **me)[0].value == 1  # not deleted

    failed = tracker(tmp_path, gateway, pushgateway_delete_on_finish=True)
    failed.log({"reward/score/mean": 0.25}, 2)
    failed.close("failed", 2, reason="NonFiniteError: ...")
    assert samples(families(gateway)["verl_hpc_run_outcome"], outcome="failed", **me)[0].value == 1

    done = tracker(tmp_path, gateway, pushgateway_delete_on_finish=True)
    done.log({"reward/score/mean": 0.75}, 3)
    with caplog.at_level("WARNING", logger="verl_hpc.tracking.prometheus_backend"):
        done.close("completed", 3)
    # the delete was accepted: no warning from the backend (caplog also holds the tracker's INFO lines
    # when an earlier test in this worker left the root logger at INFO)
    said = [r.getMessage() for r in caplog.records
            if r.name == "verl_hpc.tracking.prometheus_backend" and r.levelno >= logging.WARNING]
    assert not said, said
    # deleted on success: the gateway answers a DELETE with 202 Accepted and applies it from its
    # write queue, so a read right after may still see the group (seen once on a loaded machine)
    end = time.monotonic() + 30
    while groups(gateway) and time.monotonic() < end:
        time.sleep(0.2)
    assert groups(gateway) == []


def test_gateway_down_is_a_warning_not_a_crash(tmp_path, caplog):
    t = tracker(tmp_path, f"http://127.0.0.1:{free_port()}")
    t.log({"reward/score/mean": 0.5}, 1)
    t.close("completed", 1)
    assert "push to http://127.0.0.1" in caplog.text and "failed (1 in a row)" in caplog.text


def test_http_endpoint_still_serves_with_the_namespace_label(tmp_path):
    port = free_port()
    t = Tracker(["prometheus"], tmp_path, 10, "p", "e", None, job_name=JOB, is_main=True, plots_enabled=False,
                prometheus_port=port, namespace="team-b")
    t.log({"reward/mean": 0.75, "rollout/seconds": 0.2}, 2)
    body = get(f"http://127.0.0.1:{port}/metrics")
    t.close("completed", 2)
    assert 'verl_hpc_reward_mean{namespace="team-b"} 0.75' in body
    assert 'verl_hpc_rollout_latency_seconds_bucket{le="0.25",namespace="team-b"} 1.0' in body
