"""The checkpointer every program shares (checkpoint/checkpointer.py, built by
trainer/programs/base.py's make_checkpointer): each program resumes only from its own format, named
objects save and load their own state, and the preemption stop (save, remember the step, then
requeue or stop) is one code path."""
import logging
from types import SimpleNamespace

import pytest
import torch

from verl_hpc.checkpoint.errors import CheckpointMismatchError
from verl_hpc.config import load_config
from verl_hpc.trainer.programs.preference import FORMAT as PREFERENCE_FORMAT
from verl_hpc.trainer.programs.base import make_checkpointer, requeue_if_preempted
from verl_hpc.trainer.programs.rl import FORMAT
from verl_hpc.trainer.programs.sft import FORMAT as SFT_FORMAT


class Flag:
    def __init__(self, signal_name=None):
        self.signal_name = self.agreed_signal = signal_name
        self.calls = 0

    def agreed(self):
        self.calls += 1
        return self.signal_name is not None


class Counter:
    """A named object with its own state, as a program registers one."""

    def __init__(self, value=0, required_state=None):
        self.value = value
        if required_state:
            self.required_state = required_state

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = int(state["value"])


def job(tmp_path, signal_name=None):
    cfg = load_config(None, [f"checkpoint.dir={tmp_path}/ckpt", f"trainer.output_dir={tmp_path}/out",
                             "trainer.total_steps=5"])
    ctx = SimpleNamespace(rank=0, world_size=1, generator=torch.Generator().manual_seed(0),
                          preemption=Flag(signal_name))
    return cfg, ctx


def checkpointer(tmp_path, fmt, signal_name=None, states=None, total_steps=5):
    cfg, ctx = job(tmp_path, signal_name)
    return make_checkpointer(cfg, ctx, engines={}, states=states or {}, fmt=fmt, total_steps=total_steps)


@pytest.mark.parametrize("saved,resuming", [(FORMAT, PREFERENCE_FORMAT), (PREFERENCE_FORMAT, FORMAT),
                                            (SFT_FORMAT, FORMAT), (FORMAT, SFT_FORMAT)])
def test_each_program_resumes_only_from_its_own_checkpoints(tmp_path, saved, resuming):
    a = checkpointer(tmp_path, saved)
    assert a.resume() == 0
    a.maybe_save(2, force=True)
    assert checkpointer(tmp_path, saved).resume() == 2
    with pytest.raises(CheckpointMismatchError, match=rf"not a checkpoint of this program \(trainer_state.format="
                                                      rf"'{saved}', expected '{resuming}': trainer.job must match"):
        checkpointer(tmp_path, resuming).resume()


def test_named_states_save_and_load_themselves(tmp_path):
    a = checkpointer(tmp_path, FORMAT, states={"loader": Counter(7), "kl_ctrl": Counter(3)})
    a.resume()
    a.maybe_save(1, force=True)
    loader, kl = Counter(), Counter()
    b = checkpointer(tmp_path, FORMAT, states={"loader": loader, "kl_ctrl": kl})
    assert b.resume() == 1 and (loader.value, kl.value) == (7, 3)
    # an object the checkpoint lacks: skipped unless it says a resume cannot do without it
    extra = Counter(5)
    assert checkpointer(tmp_path, FORMAT, states={"extra": extra}).resume() == 1 and extra.value == 5
    with pytest.raises(CheckpointMismatchError, match="saved without task_weights state, which this run keeps; "
                                                      "resume with data.tasks"):
        checkpointer(tmp_path, FORMAT, states={"task_weights": Counter(required_state="resume with data.tasks")}).resume()
    with pytest.raises(ValueError, match=r"state names \['step'\] are the checkpointer's own"):
        checkpointer(tmp_path, FORMAT, states={"step": Counter()})


def test_total_steps_decides_the_last_save(tmp_path):
    c = checkpointer(tmp_path, PREFERENCE_FORMAT, total_steps=3)
    assert c.due(3) and not c.due(5)


def test_no_signal_no_stop(tmp_path):
    c = checkpointer(tmp_path, FORMAT)
    assert c.stop_if_preempted(1) is False and c.preempted_at is None and c.last_saved is None
    assert c.ctx.preemption.calls == 1  # asked every step (a collective in a real run)
    requeue_if_preempted(*job(tmp_path), c)  # nothing to do


def test_signal_saves_the_step_and_stops_then_says_how_to_resume(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg, ctx = job(tmp_path, "SIGTERM")
    c = make_checkpointer(cfg, ctx, engines={}, states={}, fmt=SFT_FORMAT, total_steps=5)
    c.resume()
    with caplog.at_level(logging.WARNING):
        assert c.stop_if_preempted(2) is True
        requeue_if_preempted(cfg, ctx, c)
    assert c.preempted_at == 2 and c.last_saved == 2
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000002"
    assert "preemption flag set after step 2; saving and stopping" in caplog.text
    assert "stopped by SIGTERM after step 2; not requeued (not a Slurm job)" in caplog.text
