"""The Tracker facade: one `log(metrics, step)` fanned out to the configured backends.

Only rank 0 writes. Every rank may build a Tracker and call it unconditionally, which keeps the
trainer free of `if rank == 0` around each log call; on the other ranks it does nothing.

Tracking must never end a training run: a backend that raises is reported once, and dropped after
a few failures in a row (a full disk, a dead W&B process) while the others carry on. Construction
is the exception: a backend the config asks for but cannot be built fails at startup, when it
costs nothing, rather than leaving a week-long run without the logs someone expected.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TextIO

from verl_hpc.config.errors import ConfigError
from verl_hpc.tracking import jsonl, plots
from verl_hpc.tracking.values import MetricCleaner

log = logging.getLogger(__name__)

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "prometheus")
OPTIONAL_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
MAX_FAILURES_IN_A_ROW = 3
PLOT_FILE = "plots/training_curves.png"


def missing_packages(backends: Iterable[str]) -> list[str]:
    """Messages for requested backends whose package is absent; cheap, so every rank can check
    before the job starts (only rank 0 builds backends, and a rank-0-only error would leave the
    others waiting in a collective)."""
    return [f"tracking.backends has {name!r} but the {pkg} package is not installed; "
            f"`pip install {pkg}` or remove it from tracking.backends"
            for name, pkg in OPTIONAL_PACKAGES.items()
            if name in backends and pkg not in sys.modules  # find_spec raises on a spec-less one
            and importlib.util.find_spec(pkg) is None]


class Tracker:
    def __init__(self, backends: Sequence[str], output_dir: str | os.PathLike, total_steps: int,
                 project: str, experiment: str, config: Mapping[str, Any] | None, is_main: bool,
                 log_every: int = 1, prometheus_port: int = 0, *, start_step: int | None = None,
                 plots_enabled: bool = True, stream: TextIO | None = None,
                 tty: bool | None = None, console_metrics: Sequence[str] = (), namespace: str = "",
                 pushgateway_url: str = "", pushgateway_delete_on_finish: bool = False,
                 alert_webhook: str = "", job_name: str) -> None:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ConfigError(f"tracking.backends: unknown {unknown}; valid: {', '.join(BACKENDS)}")
        self.is_main = bool(is_main)
        self.output_dir = Path(output_dir)
        self.total_steps = int(total_steps)
        self.title = f"{namespace} / {project} / {experiment}" if namespace else f"{project} / {experiment}"
        self.namespace = namespace
        # job_name: the Pushgateway's `job` label, the job's slurm.job_name
        self._prometheus = dict(pushgateway_url=pushgateway_url, job=job_name, namespace=namespace,
                                experiment=experiment, delete_on_finish=pushgateway_delete_on_finish)
        self.alerts = None
        self.plot_path: Path | None = None
        self._plots_enabled = plots_enabled
        self._clean = MetricCleaner()
        self._backends: dict[str, Any] = {}
        self._failures: dict[str, int] = {}
        self._memory: list[dict[str, Any]] = []  # plot inputs when there is no metrics.jsonl
        self._plot_keys: dict[str, bool] = {}
        self._closed = False
        self._console_metrics = tuple(console_metrics)
        if not self.is_main:
            return
        if alert_webhook:
            from verl_hpc.tracking.alerts import AlertWebhook

            self.alerts = AlertWebhook(alert_webhook, project=project, experiment=experiment,
                                       namespace=namespace)
        # W&B / MLflow projects are shared by everyone on a server: a namespace gets its own
        project = f"{namespace}-{project}" if namespace else project
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # console last: its rate clock starts when built, and the other backends' imports
        # (tensorboard, wandb) would otherwise count as time spent on the first step
        names = sorted(dict.fromkeys(backends), key=lambda n: n == "console")
        try:
            for name in names:  # dict.fromkeys: a name listed twice is one backend
                self._backends[name] = self._build(name, config, log_every, prometheus_port,
                                                   start_step, stream, tty, project, experiment)
        except Exception:
            for built in self._backends.values():  # no open files or served port left behind
                built.close()
            raise
        where = ", ".join(self._backends) or "nothing"
        log.info("tracking: %s -> %s", where, self.output_dir)

    def _build(self, name, config, log_every, port, start_step, stream, tty, project, experiment):
        # imports are local: each optional backend costs its import only when asked for
        if name == "console":
            from verl_hpc.tracking.console import ConsoleBackend
            return ConsoleBackend(self.total_steps, log_every, stream=stream, tty=tty,
                                  extra=self._console_metrics)
        if name == "jsonl":
            return jsonl.JsonlBackend(self.output_dir, start_step=start_step)
        if name == "tensorboard":
            from verl_hpc.tracking.tensorboard_backend import TensorBoardBackend
            return TensorBoardBackend(self.output_dir, config)
        if name == "wandb":
            from verl_hpc.tracking.wandb_backend import WandbBackend
            return WandbBackend(self.output_dir, project, experiment, config)
        if name == "mlflow":
            from verl_hpc.tracking.mlflow_backend import MlflowBackend
            return MlflowBackend(self.output_dir, project, experiment, config)
        from verl_hpc.tracking.prometheus_backend import PrometheusBackend
        return PrometheusBackend(port, **self._prometheus)

    @classmethod
    def from_config(cls, tracking, trainer, *, job_name: str, is_main: bool, start_step: int | None = None,
                    total_steps: int | None = None, config: Mapping[str, Any] | None = None) -> "Tracker":
        """The tracker the tracking and trainer sections ask for; job_name: slurm.job_name; config:
        the whole job config as a plain mapping, logged as the run's parameters."""
        tr, t = trainer, tracking
        return cls(t.backends, tr.output_dir, total_steps or tr.total_steps, tr.project_name, tr.experiment_name,
                   config, is_main=is_main, log_every=t.log_every, prometheus_port=t.prometheus_port,
                   start_step=start_step, plots_enabled=t.plots, console_metrics=t.console_metrics,
                   namespace=tr.namespace, pushgateway_url=t.pushgateway_url,
                   pushgateway_delete_on_finish=t.pushgateway_delete_on_finish,
                   alert_webhook=t.alert_webhook, job_name=job_name)

    def event(self, kind: str, step: int | None = None, **details: Any) -> None:
        """An operator-facing event (rollback, preempted, failed, requeue): counted in Prometheus,
        sent to tracking.alert_webhook. Rank 0 only, like log()."""
        if not self.is_main:
            return
        if kind not in ("failed", "preempted") and "prometheus" in self._backends:  # those: finish()
            self._call("prometheus", "event", kind, details)
        if self.alerts is not None and kind in ("rollback", "failed", "preempted"):
            self.alerts.send(kind, step, **details)

    @property
    def backends(self) -> list[str]:
        return list(self._backends)

    @property
    def metrics_path(self) -> Path | None:
        return self._backends["jsonl"].path if "jsonl" in self._backends else None

    def backend(self, name: str) -> Any:
        return self._backends.get(name)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.is_main or self._closed:
            return
        clean = self._clean(metrics)
        if "jsonl" not in self._backends:
            kept = {k: v for k, v in clean.items() if self._wanted(k)}
            if kept:
                self._memory.append({"step": int(step), **kept})
        for name in list(self._backends):
            self._call(name, "log", clean, int(step))

    def _wanted(self, name: str) -> bool:
        hit = self._plot_keys.get(name)
        if hit is None:
            hit = self._plot_keys[name] = plots.wanted(name)
        return hit

    def truncate_from(self, step: int) -> int:
        """Drop metrics-file rows from `step` on (resuming at `step`); 0 without a JSONL backend."""
        if not self.is_main or "jsonl" not in self._backends:
            return 0
        return self._backends["jsonl"].truncate_from(step)

    def _call(self, name: str, method: str, *args) -> None:
        backend = self._backends.get(name)
        fn = getattr(backend, method, None)
        if fn is None:
            return
        try:
            fn(*args)
            self._failures[name] = 0
        except Exception:
            n = self._failures.get(name, 0) + 1
            self._failures[name] = n
            log.warning("tracking: %s.%s failed (%d in a row)", name, method, n, exc_info=n == 1)
            if n >= MAX_FAILURES_IN_A_ROW:
                log.error("tracking: dropping backend %s after %d failures in a row; the others "
                          "go on", name, n)
                self._backends.pop(name, None)
                try:
                    backend.close()
                except Exception:
                    pass

    def close(self, outcome: str | None = None, step: int | None = None, reason: str = "") -> Path | None:
        """Write the plots, hand them to backends that store files, close everything. Idempotent;
        returns the plot's path (None when nothing was plotted or on ranks other than 0).

        outcome (completed | failed | preempted): how the run ended; pushed to a Pushgateway and,
        for failed / preempted, sent to tracking.alert_webhook."""
        if not self.is_main or self._closed:
            return self.plot_path
        self._closed = True
        if outcome is not None:
            if outcome in ("failed", "preempted"):
                self.event(outcome, step, **({"reason": reason} if reason else {}))
            if "prometheus" in self._backends:
                self._call("prometheus", "finish", outcome)
        if self._plots_enabled:
            self._write_plots()
        for name in list(self._backends):
            self._call(name, "close")
        return self.plot_path

    def _write_plots(self) -> None:
        # the file, not memory: after a restart it also holds the steps of earlier attempts
        path = self.metrics_path
        history = jsonl.read_history(path) if path is not None else self._memory
        try:
            result = plots.write_plots(history, self.output_dir / PLOT_FILE, title=self.title)
        except Exception:
            log.warning("tracking: writing plots failed", exc_info=True)
            return
        if result is None:
            log.info("tracking: no reward/accuracy/KL/entropy/length metrics logged; no plots")
            return
        self.plot_path = result.path
        log.info("tracking: plots (%s) -> %s", ", ".join(result.panels), result.path)
        for name in list(self._backends):
            self._call(name, "log_artifact", result.path)
        if "console" in self._backends:
            self._call("console", "note", f"plots: {result.path}")

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
