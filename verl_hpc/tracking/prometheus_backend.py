"""Prometheus gauges for the latest value of every metric, served over HTTP on rank 0.

A cluster's Prometheus (or `curl node:port/metrics`) sees the run live without reading files.
Gauges live in a private registry, not prometheus_client's global one, so two trackers in one
process (tests, an SFT warm start followed by RL) do not collide on metric names.
"""
from __future__ import annotations

import logging
import re
from typing import Mapping

log = logging.getLogger(__name__)

PREFIX = "verl_hpc_"


def sanitize(name: str) -> str:
    """`val/acc/gsm8k` -> `verl_hpc_val_acc_gsm8k`: Prometheus allows [a-zA-Z0-9_:] only."""
    return PREFIX + re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9_]", "_", name)).strip("_")


class PrometheusBackend:
    def __init__(self, port: int = 0, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self._Gauge = Gauge
        self.registry = CollectorRegistry()
        self._gauges: dict[str, object] = {}
        self._taken: set[str] = {PREFIX + "step"}
        self._step = Gauge(PREFIX + "step", "last logged training step", registry=self.registry)
        self._server = None
        self.port = int(port)
        if self.port <= 0:
            log.warning("tracking: prometheus backend without tracking.prometheus_port: gauges "
                        "are kept but not served")
            return
        from prometheus_client import start_http_server

        try:
            self._server, _thread = start_http_server(self.port, addr=addr, registry=self.registry)
        except OSError as e:  # another job on the node holds the port: lose the endpoint, not the run
            log.warning("tracking: cannot serve prometheus metrics on port %d (%s); continuing "
                        "without it", self.port, e)

    def _gauge(self, name: str):
        gauge = self._gauges.get(name)
        if gauge is None:
            metric = sanitize(name)
            base, n = metric, 2
            while metric in self._taken:  # `a/b` and `a_b` sanitise alike: keep both apart
                metric, n = f"{base}_{n}", n + 1
            self._taken.add(metric)
            gauge = self._Gauge(metric, f"verl_hpc metric {name}", registry=self.registry)
            self._gauges[name] = gauge
        return gauge

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._step.set(step)
        for name, value in metrics.items():
            self._gauge(name).set(value)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
