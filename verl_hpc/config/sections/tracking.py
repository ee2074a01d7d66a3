"""`tracking:` where metrics go."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from verl_hpc.config.fields import Section, opt

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "prometheus")


@dataclass
class TrackingConfig(Section):
    backends: List[str] = opt(["console", "jsonl"], "metric sinks", choices=BACKENDS)
    log_every: int = opt(1, "steps between logged rows", check=">0")
    prometheus_port: int = opt(0, "needed with the prometheus backend", check="[0, 65535]")
    plots: bool = opt(True, "PNG plots of reward, val accuracy, KL, ... at the end")
    console_metrics: List[str] = opt([], "extra metric keys shown in the console table")
    wandb_mode: str = opt("offline", "W&B mode", choices=("offline", "online", "disabled"))

    def check(self, job) -> List[str]:
        if "prometheus" in self.backends and self.prometheus_port <= 0:
            return ["tracking.prometheus_port: must be > 0 when tracking.backends includes prometheus"]
        return []
