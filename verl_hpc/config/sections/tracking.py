"""`tracking:` where metrics go, and where alerts go."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import Section, opt

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "prometheus")
URL_SCHEMES = ("http://", "https://")


@dataclass
class TrackingConfig(Section):
    backends: List[str] = opt(["console", "jsonl"], "metric sinks", choices=BACKENDS)
    log_every: int = opt(1, "steps between logged rows", check=">0")
    prometheus_port: int = opt(0, "prometheus backend: rank 0 serves /metrics on this port (0 = not served)",
                               check="[0, 65535]")
    pushgateway_url: str = opt("", "prometheus backend: push to this Pushgateway at every logged step and at exit, "
                                   "e.g. http://pushgw:9091 (batch jobs on nodes Prometheus cannot find)")
    pushgateway_delete_on_finish: bool = opt(False, "delete this job's series from the Pushgateway when it "
                                                    "completes (failed or preempted runs stay visible)")
    alert_webhook: str = opt("", "POST a small JSON body here on rollbacks, failures and preemptions")
    plots: bool = opt(True, "PNG plots of reward, val accuracy, KL, ... at the end")
    console_metrics: List[str] = opt([], "extra metric keys shown in the console table")
    wandb_mode: str = opt("offline", "W&B mode", choices=("offline", "online", "disabled"))
    comm_bytes: bool = opt(False, "per stage: payload bytes and calls of every collective, as metrics "
                                  "comm_bytes/<stage>/<collective>@<group> (benchmarks/bench_scaling.py)")
    stage_memory: bool = opt(True, "per stage: peak memory and what the stage added to it, as metrics "
                                   "mem_peak_gib/<stage> and mem_rise_gib/<stage> (GPU: torch's allocated "
                                   "bytes; CPU: the process's resident set)")

    def check(self, job) -> List[str]:
        p = []
        if "prometheus" in self.backends and self.prometheus_port <= 0 and not self.pushgateway_url:
            p.append("tracking.prometheus_port: must be > 0 (or tracking.pushgateway_url set) when "
                     "tracking.backends includes prometheus")
        if self.pushgateway_url and "prometheus" not in self.backends:
            p.append(f"tracking.pushgateway_url = '{self.pushgateway_url}' needs 'prometheus' in tracking.backends")
        for key in ("pushgateway_url", "alert_webhook"):
            url = getattr(self, key)
            if url and not url.startswith(URL_SCHEMES):
                p.append(f"tracking.{key} = '{url}': expected an http:// or https:// URL")
        return p
