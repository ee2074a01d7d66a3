"""Prometheus: gauges with sanitised names served on a port, scraped over HTTP."""
import socket
import urllib.request

import pytest

from verl_hpc.config import JobConfig
from verl_hpc.tracking import Tracker
from verl_hpc.tracking.prometheus_backend import PrometheusBackend, sanitize

JOB = JobConfig().slurm.job_name  # the Pushgateway's job label a default config gives


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_sanitize():
    assert sanitize("val/acc/synthetic_arith") == "verl_hpc_val_acc_synthetic_arith"
    assert sanitize("perf/tokens-per.s") == "verl_hpc_perf_tokens_per_s"


def test_scrape_latest_values(tmp_path):
    port = free_port()
    tracker = Tracker(["prometheus"], tmp_path, 10, "p", "e", None, job_name=JOB, is_main=True,
                      prometheus_port=port, plots_enabled=False)
    tracker.log({"reward/mean": 0.25, "val/acc/synthetic_arith": 0.5}, 1)
    tracker.log({"reward/mean": 0.75, "actor/kl": float("nan"), "actor_kl": 2.0}, 2)
    body = scrape(port)
    assert "verl_hpc_reward_mean 0.75" in body
    assert "verl_hpc_val_acc_synthetic_arith 0.5" in body
    assert "verl_hpc_step 2.0" in body
    assert "verl_hpc_actor_kl NaN" in body and "verl_hpc_actor_kl_2 2.0" in body  # no clash
    tracker.close()
    with pytest.raises(OSError):
        scrape(port)  # the server is gone with the tracker


def test_port_in_use_is_a_warning_not_a_crash(caplog):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        backend = PrometheusBackend(port=s.getsockname()[1], job=JOB)
        backend.log({"reward/mean": 1.0}, 1)
        backend.close()
    assert "cannot serve prometheus metrics" in caplog.text


def test_histogram_keys_become_one_gauge_with_a_bucket_label():
    from prometheus_client import generate_latest

    backend = PrometheusBackend(job=JOB)
    backend.log({"async/staleness/hist/0": 5.0, "async/staleness/hist/2": 1.0}, 1)
    first = generate_latest(backend.registry).decode()
    assert 'verl_hpc_async_staleness_hist{bucket="1"} 0.0' in first  # between two logged buckets
    backend.log({"async/staleness/hist/0": 7.0, "async/staleness_max": 0.0}, 2)
    body = generate_latest(backend.registry).decode()
    backend.close()
    assert "# TYPE verl_hpc_async_staleness_hist gauge" in body
    assert 'verl_hpc_async_staleness_hist{bucket="0"} 7.0' in body
    assert 'verl_hpc_async_staleness_hist{bucket="2"} 0.0' in body  # absent this step: 0, not 1
    assert "verl_hpc_async_staleness_max 0.0" in body
    assert "verl_hpc_async_staleness_hist_0" not in body  # no gauge per bucket
