"""W&B and MLflow adapters against fake modules in sys.modules (neither package is installed).

The fakes take only the argument names the real APIs take (wandb.init, Run.log/save/finish;
MlflowClient, entities.Metric/Param), so a misspelt or invented argument fails here.
"""
import os
import sys
import types
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest

from verl_hpc.config import JobConfig
from verl_hpc.tracking import Tracker, missing_packages

JOB = JobConfig().slurm.job_name  # the Pushgateway's job label a default config gives


# ---------------------------------------------------------------- wandb
class FakeHistogram:
    """wandb.Histogram's arguments and its checks on a precomputed histogram."""

    def __init__(self, sequence=None, np_histogram=None, num_bins=64):
        assert sequence is None and np_histogram is not None
        self.histogram, self.bins = (list(x) for x in np_histogram)
        assert len(self.bins) == len(self.histogram) + 1 and len(self.histogram) <= 512


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, data, step=None, commit=None):
        assert isinstance(data, dict) and all(isinstance(v, (float, FakeHistogram)) for v in data.values())
        self.calls.append(("log", dict(data), step))

    def save(self, glob_str=None, base_path=None, policy="live"):
        assert policy in ("live", "now", "end")
        self.calls.append(("save", glob_str, base_path, policy))

    def finish(self, exit_code=None, quiet=None):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    mod = types.ModuleType("wandb")

    def init(*, entity=None, project=None, dir=None, id=None, name=None, notes=None, tags=None,
             config=None, group=None, job_type=None, mode=None, resume=None, settings=None,
             reinit=None):
        assert mode in (None, "online", "offline", "disabled")
        calls.append(("init", dict(project=project, name=name, dir=dir, config=config, mode=mode)))
        return FakeRun(calls)

    mod.init = init
    mod.Histogram = FakeHistogram
    monkeypatch.setitem(sys.modules, "wandb", mod)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return calls


def test_wandb_offline_run_in_output_dir(tmp_path, fake_wandb):
    assert missing_packages(["wandb"]) == []
    tracker = Tracker(["wandb"], tmp_path, 3, "proj", "exp1", {"actor": {"lr": 1e-6}},
                      job_name=JOB, is_main=True)
    tracker.log({"reward/mean": 0.5, "actor/kl": float("nan")}, 1)
    tracker.log({"reward/mean": 0.75, "actor/entropy": 1.0}, 2)
    plot = tracker.close()
    (_, init), *rest = fake_wandb
    assert init == dict(project="proj", name="exp1", dir=str(tmp_path),
                        config={"actor": {"lr": 1e-6}}, mode="offline")
    logs = [c for c in rest if c[0] == "log"]
    assert [(c[1]["reward/mean"], c[2]) for c in logs] == [(0.5, 1), (0.75, 2)]
    assert ("save", str(plot), str(plot.parent), "now") in rest  # the plot goes with the run
    assert rest[-1] == ("finish",)


def test_wandb_mode_from_environment(tmp_path, fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    Tracker(["wandb"], tmp_path, 1, "p", "e", None, job_name=JOB, is_main=True).close()
    assert fake_wandb[0][1]["mode"] == "online"


# ---------------------------------------------------------------- mlflow
class Store:
    def __init__(self):
        self.uri = None
        self.experiments = {}
        self.runs = {}


@pytest.fixture
def fake_mlflow(monkeypatch):
    store = Store()

    class Metric:
        def __init__(self, key, value, timestamp, step, **_):
            assert isinstance(key, str) and isinstance(value, float)
            assert isinstance(timestamp, int) and isinstance(step, int)
            self.key, self.value, self.timestamp, self.step = key, value, timestamp, step

    class Param:
        def __init__(self, key, value):
            assert isinstance(key, str) and isinstance(value, str)
            self.key, self.value = key, value

    class MlflowClient:
        def __init__(self, tracking_uri=None, registry_uri=None):
            store.uri = tracking_uri

        def get_experiment_by_name(self, name):
            eid = store.experiments.get(name)
            return None if eid is None else types.SimpleNamespace(experiment_id=eid, name=name)

        def create_experiment(self, name, artifact_location=None, tags=None):
            store.experiments[name] = str(len(store.experiments))
            return store.experiments[name]

        def create_run(self, experiment_id, start_time=None, tags=None, run_name=None):
            rid = f"run{len(store.runs)}"
            store.runs[rid] = dict(exp=experiment_id, name=run_name, params={}, metrics=[],
                                   artifacts=[], status="RUNNING")
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id=rid))

        def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
            assert len(metrics) <= 1000 and len(params) <= 100  # the server's limits
            run = store.runs[run_id]
            run["params"].update({p.key: p.value for p in params})
            run["metrics"] += [(m.key, m.value, m.step) for m in metrics]

        def log_artifact(self, run_id, local_path, artifact_path=None):
            store.runs[run_id]["artifacts"].append(local_path)

        def set_terminated(self, run_id, status=None, end_time=None):
            store.runs[run_id]["status"] = status

    root = types.ModuleType("mlflow")
    entities = types.ModuleType("mlflow.entities")
    tracking = types.ModuleType("mlflow.tracking")
    entities.Metric, entities.Param = Metric, Param
    tracking.MlflowClient = MlflowClient
    root.entities, root.tracking = entities, tracking
    for name, mod in (("mlflow", root), ("mlflow.entities", entities),
                      ("mlflow.tracking", tracking)):
        monkeypatch.setitem(sys.modules, name, mod)
    return store


def test_mlflow_file_store_params_metrics_artifact(tmp_path, fake_mlflow):
    config = {"trainer": {"total_steps": 2}, "big": {f"k{i}": i for i in range(150)},
              "long": "x" * 2000}
    tracker = Tracker(["mlflow"], tmp_path, 2, "proj", "exp1", config, job_name=JOB, is_main=True)
    tracker.log({"reward/mean": 0.5, "val/acc/arith": 0.25}, 1)
    tracker.log({"reward/mean": 0.75}, 2)
    plot = tracker.close()
    store_dir = Path(url2pathname(urlparse(fake_mlflow.uri).path))
    assert fake_mlflow.uri.startswith("file://") and store_dir == (tmp_path / "mlruns").resolve()
    assert store_dir.is_dir()
    assert list(fake_mlflow.experiments) == ["proj"]
    (run,) = fake_mlflow.runs.values()
    assert run["name"] == "exp1" and run["status"] == "FINISHED"
    assert run["params"]["trainer.total_steps"] == "2" and len(run["params"]) == 152
    assert len(run["params"]["long"]) == 500
    assert sorted(run["metrics"]) == [("reward/mean", 0.5, 1), ("reward/mean", 0.75, 2),
                                      ("val/acc/arith", 0.25, 1)]
    assert run["artifacts"] == [str(plot)]


def test_mlflow_reuses_experiment_across_restarts(tmp_path, fake_mlflow):
    for _ in range(2):
        Tracker(["mlflow"], tmp_path, 1, "proj", "exp", None, job_name=JOB, is_main=True).close()
    assert list(fake_mlflow.experiments) == ["proj"] and len(fake_mlflow.runs) == 2


def test_absent_packages_named_with_the_field(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="tracking.backends"):
        Tracker(["jsonl", "wandb"], tmp_path, 1, "p", "e", None, job_name=JOB, is_main=True)
    # the jsonl backend built before wandb failed was closed again: no file handle left open
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert str(tmp_path / "metrics.jsonl") not in fds


def test_histogram_keys_go_to_wandb_as_one_histogram_and_to_mlflow_as_they_are(tmp_path, fake_wandb,
                                                                              fake_mlflow):
    tracker = Tracker(["wandb", "mlflow"], tmp_path, 1, "p", "e", None, job_name=JOB, is_main=True,
                      plots_enabled=False)
    wide = {"wide/hist/0": 1.0, "wide/hist/600": 2.0}  # 601 buckets: past W&B's 512, kept as scalars
    tracker.log({"async/staleness_mean": 0.5, "async/staleness/hist/0": 4.0,
                 "async/staleness/hist/2": 1.0, **wide}, 1)
    tracker.close()
    (data,) = [c[1] for c in fake_wandb if c[0] == "log"]
    assert sorted(data) == ["async/staleness/hist", "async/staleness_mean", *sorted(wide)]
    h = data["async/staleness/hist"]
    assert h.histogram == [4.0, 0.0, 1.0] and h.bins == [-0.5, 0.5, 1.5, 2.5]
    (run,) = fake_mlflow.runs.values()
    assert sorted(k for k, _, _ in run["metrics"]) == [
        "async/staleness/hist/0", "async/staleness/hist/2", "async/staleness_mean", *sorted(wide)]
