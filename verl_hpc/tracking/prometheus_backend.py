"""Prometheus: the latest value of every metric as a gauge, histograms of rollout latency and of
step time by stage, counters of the events an operator pages on; served over HTTP on rank 0
and/or pushed to a Pushgateway.

A batch job runs on a node the site's Prometheus does not know and is gone when it ends, so the
HTTP endpoint (`tracking.prometheus_port`) suits interactive runs, and a Pushgateway
(`tracking.pushgateway_url`) suits Slurm jobs: every logged step and the exit (completed, failed,
preempted) are pushed under the grouping key job/instance/namespace/experiment, where Prometheus
scrapes them (with `honor_labels: true`). `pushadd` (POST) replaces only the metric families we
push, so the outcome gauge written at exit does not erase the run's last values.

A histogram logged as `<prefix>/hist/<int>` bucket counts (histograms.py) is one gauge family
with a `bucket` label, `verl_hpc_async_staleness_hist{bucket="2"}`: the last step's counts. Not a
Prometheus Histogram: that one counts observations since the start, while these counts describe
one step (the trained batch), and a gauge keeps that meaning. A bucket logged at an earlier step
and absent now reads 0, not its old count.

Metrics live in a private registry, not prometheus_client's global one, so two trackers in one
process (tests, an SFT warm start followed by RL) do not collide on metric names.
"""
from __future__ import annotations

import logging
import os
import re
import socket
from typing import Mapping, Optional

from verl_hpc.tracking.histograms import Histogram, split_histograms

log = logging.getLogger(__name__)

PREFIX = "verl_hpc_"
# Seconds; rollout calls and RL stages range from ~10 ms (tiny CPU tests) to many minutes (70B).
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
OUTCOMES = ("running", "completed", "failed", "preempted")
ROLLOUT_SECONDS = "rollout/seconds"  # wall time of one generate call (rollout/metrics.py)
STAGE_PREFIX = "timing_s/"
EVENTS = {"rollback": "rollbacks", "preempted": "preemptions", "requeue": "requeues"}


def sanitize(name: str) -> str:
    """`val/acc/gsm8k` -> `verl_hpc_val_acc_gsm8k`: Prometheus allows [a-zA-Z0-9_:] only."""
    return PREFIX + re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9_]", "_", name)).strip("_")


class _WithLabels:
    """A collector re-emitting another registry's samples with extra labels (the namespace on the
    HTTP endpoint; a Pushgateway gets them from its grouping key instead)."""

    def __init__(self, source, labels: Mapping[str, str]) -> None:
        self.source, self.labels = source, dict(labels)

    def collect(self):
        from prometheus_client.metrics_core import Metric

        for family in self.source.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp, s.exemplar)
            yield out


class PrometheusBackend:
    def __init__(self, port: int = 0, addr: str = "0.0.0.0", *, pushgateway_url: str = "",
                 job: str, namespace: str = "", experiment: str = "",
                 delete_on_finish: bool = False, instance: Optional[str] = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self._Gauge = Gauge
        self.registry = CollectorRegistry()
        self._gauges: dict[tuple[str, tuple[str, ...]], object] = {}
        self._buckets: dict[str, set[int]] = {}  # histogram name -> every bucket it has had
        r = self.registry
        self._step = Gauge(PREFIX + "step", "last logged training step", registry=r)
        self._outcome = Gauge(PREFIX + "run_outcome", "1 for the run's current state", ["outcome"], registry=r)
        self.rollout_latency = Histogram(PREFIX + "rollout_latency_seconds",
                                         "wall time of one rollout request batch (a generate call)",
                                         buckets=BUCKETS, registry=r)
        self.stage_seconds = Histogram(PREFIX + "stage_seconds", "seconds per RL step, by stage "
                                       "(stage=step is the whole step)", ["stage"], buckets=BUCKETS, registry=r)
        self.nonfinite = Counter(PREFIX + "nonfinite_skipped_steps", "steps whose update was skipped for a "
                                 "non-finite loss or grad norm", registry=r)
        self.events = {kind: Counter(PREFIX + name, f"{name} of this job", registry=r)
                       for kind, name in EVENTS.items()}
        self._taken: set[str] = {m for m in r._names_to_collectors}  # no gauge may shadow these
        self._set_outcome("running")
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if restarts > 0:  # Slurm counts the requeues of a job; this attempt reports them
            self.events["requeue"].inc(restarts)

        self.job, self.delete_on_finish = job, bool(delete_on_finish)
        self.pushgateway_url = pushgateway_url.rstrip("/")
        self.grouping = {"instance": instance or _instance()}
        if namespace:
            self.grouping["namespace"] = namespace
        if experiment:
            self.grouping["experiment"] = experiment
        self._push_failures = 0

        self._server = None
        self.port = int(port)
        if self.port <= 0:
            if not self.pushgateway_url:
                log.warning("tracking: prometheus backend without tracking.prometheus_port or "
                            "tracking.pushgateway_url: metrics are kept but neither served nor pushed")
            return
        from prometheus_client import start_http_server

        served = r
        if namespace:
            served = CollectorRegistry(auto_describe=False)
            served.register(_WithLabels(r, {"namespace": namespace}))
        try:
            self._server, _thread = start_http_server(self.port, addr=addr, registry=served)
        except OSError as e:  # another job on the node holds the port: lose the endpoint, not the run
            log.warning("tracking: cannot serve prometheus metrics on port %d (%s); continuing "
                        "without it", self.port, e)

    def _gauge(self, name: str, labels: tuple[str, ...] = ()):
        gauge = self._gauges.get((name, labels))
        if gauge is None:
            metric = sanitize(name)
            base, n = metric, 2
            while metric in self._taken:  # `a/b` and `a_b` sanitise alike: keep both apart
                metric, n = f"{base}_{n}", n + 1
            self._taken.add(metric)
            gauge = self._Gauge(metric, f"verl_hpc metric {name}", labels, registry=self.registry)
            self._gauges[(name, labels)] = gauge
        return gauge

    def _histogram(self, h: Histogram) -> None:
        gauge = self._gauge(h.name, ("bucket",))
        seen = self._buckets.setdefault(h.name, set())
        seen.update(h.buckets)
        for b in sorted(seen):
            gauge.labels(bucket=str(b)).set(h.counts[b - h.low] if b in h.buckets else 0.0)

    def _set_outcome(self, outcome: str) -> None:
        for o in OUTCOMES:
            self._outcome.labels(outcome=o).set(1.0 if o == outcome else 0.0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._step.set(step)
        scalars, hists = split_histograms(metrics)
        for h in hists:
            self._histogram(h)
        for name, value in scalars.items():
            self._gauge(name).set(value)
            if name == ROLLOUT_SECONDS and value == value:
                self.rollout_latency.observe(value)
            elif name.startswith(STAGE_PREFIX) and value == value:
                self.stage_seconds.labels(stage=name[len(STAGE_PREFIX):]).observe(value)
            elif name.endswith("/nonfinite_steps") and value > 0:
                self.nonfinite.inc()
        self.push()

    def event(self, kind: str, details: Mapping) -> None:
        """A rollback / preemption / requeue happened: count it (and push at once)."""
        counter = self.events.get(kind)
        if counter is not None:
            counter.inc()
            self.push()

    def push(self) -> None:
        """pushadd to the Pushgateway; a gateway that is down costs a warning, never the run."""
        if not self.pushgateway_url:
            return
        from prometheus_client import pushadd_to_gateway

        try:
            pushadd_to_gateway(self.pushgateway_url, job=self.job, registry=self.registry,
                               grouping_key=self.grouping, timeout=10)
            self._push_failures = 0
        except Exception as e:  # URLError, HTTPError, timeouts: the gateway is not the run
            self._push_failures += 1
            if self._push_failures in (1, 10) or self._push_failures % 100 == 0:
                log.warning("tracking: push to %s failed (%d in a row): %s", self.pushgateway_url,
                            self._push_failures, e)

    def finish(self, outcome: str) -> None:
        """The run ends: completed | failed | preempted. Pushed last; a completed run's series are
        deleted when tracking.pushgateway_delete_on_finish asks for it."""
        if outcome == "preempted":
            self.events["preempted"].inc()
        self._set_outcome(outcome if outcome in OUTCOMES else "failed")
        self.push()
        if self.pushgateway_url and self.delete_on_finish and outcome == "completed":
            from prometheus_client import delete_from_gateway

            try:
                delete_from_gateway(self.pushgateway_url, job=self.job, grouping_key=self.grouping, timeout=10)
            except Exception as e:
                log.warning("tracking: deleting this job's series from %s failed: %s", self.pushgateway_url, e)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _instance() -> str:
    """host:rank-0 Slurm job id (or pid): unique per attempt-independent job on a cluster."""
    job = os.environ.get("SLURM_JOB_ID") or f"pid{os.getpid()}"
    return f"{socket.gethostname()}:{job}"
