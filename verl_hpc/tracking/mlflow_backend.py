"""MLflow with a file store under `<output_dir>/mlruns` (`mlflow ui --backend-store-uri ...`).

MlflowClient rather than the fluent `mlflow.start_run` API: the fluent API keeps an active run and
a tracking URI in global state, which would leak into (or from) any user code in the same process.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from verl_hpc.tracking.values import flatten_config

SUBDIR = "mlruns"
MAX_PARAMS_PER_BATCH = 100     # MLflow's log_batch limits
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_CHARS = 500          # the smallest param value limit across MLflow versions


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


class MlflowBackend:
    def __init__(self, output_dir: str | os.PathLike, project: str, experiment: str,
                 config: Mapping[str, Any] | None = None) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError("tracking.backends has 'mlflow' but the mlflow package is not "
                              "installed; `pip install mlflow` or remove it from the list") from e
        self._Metric = Metric
        self.store = (Path(output_dir) / SUBDIR).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.store.as_uri())
        # MLflow experiment = our project, MLflow run = our experiment (one training run)
        found = self._client.get_experiment_by_name(project)
        exp_id = found.experiment_id if found is not None else self._client.create_experiment(project)
        self.run_id = self._client.create_run(exp_id, run_name=experiment).info.run_id
        params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten_config(config).items()]
        for chunk in _chunks(params, MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        rows = [self._Metric(k, v, now_ms, step) for k, v in metrics.items()]
        for chunk in _chunks(rows, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk)

    def log_artifact(self, path: str | os.PathLike) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED")
