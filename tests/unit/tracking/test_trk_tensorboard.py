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
