"""TensorBoard: scalars written under <output_dir>/tensorboard and read back by tensorboard."""
import math

import pytest

from verl_hpc.config import JobConfig
from verl_hpc.tracking import Tracker

JOB = JobConfig().slurm.job_name  # the Pushgateway's job label a default config gives


def test_event_file_readable_by_event_accumulator(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(["tensorboard"], tmp_path, 3, "p", "e", {"algorithm": {"adv": "grpo"}},
                      job_name=JOB, is_main=True, plots_enabled=False)
    for step in (1, 2, 3):
        tracker.log({"reward/mean": 0.25 * step, "actor/kl": math.nan if step == 2 else 0.01},
                    step)
    tracker.close()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"reward/mean", "actor/kl"} <= set(acc.Tags()["scalars"])
    reward = acc.Scalars("reward/mean")
    assert [(e.step, e.value) for e in reward] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    kl = [e.value for e in acc.Scalars("actor/kl")]
    assert math.isnan(kl[1]) and kl[2] == pytest.approx(0.01)  # NaN logged as it is
    assert any("config" in tag for tag in acc.Tags()["tensors"])  # the run's settings


def test_histogram_keys_become_one_tensorboard_histogram(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(["tensorboard"], tmp_path, 2, "p", "e", None, job_name=JOB, is_main=True,
                      plots_enabled=False)
    tracker.log({"async/staleness_mean": 0.01, "async/staleness/hist/0": 812.0,
                 "async/staleness/hist/2": 3.0}, 1)  # bucket 1 not logged: 0
    tracker.log({"async/staleness/hist/0": 0.0}, 2)  # nothing trained: no histogram to draw
    tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["histograms"] == ["async/staleness/hist"]
    assert acc.Tags()["scalars"] == ["async/staleness_mean"]  # no scalar per bucket
    (event,) = acc.Histograms("async/staleness/hist")
    h = event.histogram_value
    assert event.step == 1 and (h.min, h.max, h.num, h.sum, h.sum_squares) == (0, 2, 815, 6, 12)
    assert list(h.bucket_limit) == [0.5, 1.5, 2.5] and list(h.bucket) == [812, 0, 3]
