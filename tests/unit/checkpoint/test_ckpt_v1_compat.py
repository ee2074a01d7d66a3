"""Checkpoints written before the checkpointer took named objects (v1/, made by v1/make_v1.py with
the code of f58ee29, when TrainerCheckpointer took the loader, KL controller, guard, task weights
and rollback state by name) still load: the programs register their objects under the names that
code wrote, so an RL or DPO run resumes from them as it did."""
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from verl_hpc.algorithms import make_kl_controller
from verl_hpc.config import load_config
from verl_hpc.data.sampler import EpochSampler
from verl_hpc.trainer.hooks.guard import NonFiniteGuard
from verl_hpc.trainer.programs.preference import FORMAT as PREFERENCE_FORMAT
from verl_hpc.trainer.programs.base import make_checkpointer
from verl_hpc.trainer.programs.rl import FORMAT
from verl_hpc.trainer.hooks.rollback import RollbackGuard
from verl_hpc.trainer.hooks.task_weights import TaskWeightScheduler

V1 = Path(__file__).parent / "v1"


class Engine:
    def __init__(self):
        self.w, self.meta = torch.zeros(3, 4), None

    def load_state(self, load_into, meta):
        from verl_hpc.checkpoint import ShardedTensor

        load_into([ShardedTensor("model/w", self.w)])
        self.meta = dict(meta)


def _job(tmp_path, name):
    shutil.copytree(V1 / name, tmp_path / name)
    cfg = load_config(None, [f"checkpoint.dir={tmp_path}/{name}", f"trainer.output_dir={tmp_path}/out",
                             "trainer.total_steps=4", "trainer.rollback.enable=true"])
    ctx = SimpleNamespace(rank=0, world_size=1, generator=torch.Generator().manual_seed(0))
    return cfg, ctx


def _expected_sampler():
    s = EpochSampler(10, seed=1, fingerprint="fp")
    s.next_indices(13)
    return s.state_dict()


def test_an_rl_checkpoint_of_the_old_checkpointer_resumes(tmp_path):
    cfg, ctx = _job(tmp_path, "rl_v1")
    engine, sampler = Engine(), EpochSampler(10, seed=1, fingerprint="fp")
    kl, guard = make_kl_controller("adaptive", 0.1, 0.5, 100), NonFiniteGuard(3)
    tasks = TaskWeightScheduler({"easy": 1.0, "hard": 1.0}, schedule="none", metric="acc", patience=2,
                                min_delta=0.0, saturation=0.95, decay=0.5, min_weight=0.1)
    rollback = RollbackGuard(cfg, ctx)
    ckpt = make_checkpointer(cfg, ctx, engines={"actor": engine}, fmt=FORMAT, total_steps=4,
                             states={"loader": sampler, "kl_ctrl": kl, "guard": guard, "task_weights": tasks,
                                     "rollback": rollback})
    assert ckpt.resume() == 3
    assert torch.equal(engine.w, torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7)
    assert engine.meta == {"lr_step": 5}
    assert sampler.state_dict() == _expected_sampler()
    assert kl.value == 0.125 and (guard.in_a_row, guard.total) == (1, 2)
    assert tasks.weights == {"easy": 1.0, "hard": 0.5}
    assert (rollback.count, rollback.lr_factor) == (1, 0.5)


def test_a_dpo_checkpoint_of_the_old_checkpointer_resumes(tmp_path):
    cfg, ctx = _job(tmp_path, "dpo_v1")
    engine, sampler = Engine(), EpochSampler(10, seed=1, fingerprint="fp")
    ckpt = make_checkpointer(cfg, ctx, engines={"actor": engine}, states={"loader": sampler},
                             fmt=PREFERENCE_FORMAT, total_steps=4)
    assert ckpt.resume() == 3
    assert sampler.state_dict() == _expected_sampler() and engine.meta == {"lr_step": 5}
