"""TrainerCheckpointer as shared by the RL and preference trainers: each resumes only from its own
format, and the preemption stop (save, remember the step, then requeue or stop) is one code path."""
import logging
from types import SimpleNamespace

import pytest
import torch

from verl_hpc.checkpoint.trainer_state import FORMAT, PREFERENCE_FORMAT, TrainerCheckpointer
from verl_hpc.config import load_config


class Flag:
    def __init__(self, signal_name=None):
        self.signal_name = self.agreed_signal = signal_name
        self.calls = 0

    def agreed(self):
        self.calls += 1
        return self.signal_name is not None


def checkpointer(tmp_path, fmt, signal_name=None, **kw):
    cfg = load_config(None, [f"checkpoint.dir={tmp_path}/ckpt", f"trainer.output_dir={tmp_path}/out",
                             "trainer.total_steps=5"])
    ctx = SimpleNamespace(rank=0, world_size=1, generator=torch.Generator().manual_seed(0),
                          preemption=Flag(signal_name))
    return TrainerCheckpointer(cfg, ctx, SimpleNamespace(actor=None, critic=None), fmt=fmt, **kw)


@pytest.mark.parametrize("saved,resuming", [(FORMAT, PREFERENCE_FORMAT), (PREFERENCE_FORMAT, FORMAT)])
def test_each_trainer_resumes_only_from_its_own_checkpoints(tmp_path, saved, resuming):
    a = checkpointer(tmp_path, saved)
    assert a.resume() == 0
    a.maybe_save(2, force=True)
    assert checkpointer(tmp_path, saved).resume() == 2
    with pytest.raises(ValueError, match=rf"not a checkpoint of this trainer \(trainer_state.format='{saved}', "
                                         rf"expected '{resuming}': trainer.job must match"):
        checkpointer(tmp_path, resuming).resume()


def test_total_steps_override_decides_the_last_save(tmp_path):
    c = checkpointer(tmp_path, PREFERENCE_FORMAT, total_steps=3)
    assert c.due(3) and not c.due(5)


def test_no_signal_no_stop(tmp_path):
    c = checkpointer(tmp_path, FORMAT)
    assert c.stop_if_preempted(1) is False and c.preempted_at is None and c.last_saved is None
    assert c.ctx.preemption.calls == 1  # asked every step (a collective in a real run)
    c.requeue_if_preempted()  # nothing to do


def test_signal_saves_the_step_and_stops_then_says_how_to_resume(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    c = checkpointer(tmp_path, PREFERENCE_FORMAT, signal_name="SIGTERM")
    c.resume()
    with caplog.at_level(logging.WARNING):
        assert c.stop_if_preempted(2) is True
        c.requeue_if_preempted()
    assert c.preempted_at == 2 and c.last_saved == 2
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000002"
    assert "preemption flag set after step 2; saving and stopping" in caplog.text
    assert "stopped by SIGTERM after step 2; not requeued (not a Slurm job)" in caplog.text
