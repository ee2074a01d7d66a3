"""The order of the rollout's sleep / wake(tags) / weight sync and the engines' state() / load calls
over whole runs of RLTrainer.fit (issue 27, defects 1 and 4), with fake roles and a rollout that
behaves like vLLM in sleep mode at level 2 (sleep drops weights and KV cache; load_weights needs
the weights mapped; generate needs everything mapped and the weights loaded since the last sleep).

What must hold: the sync is lazy (right before a generation that needs it, never at the end of a
step); it wakes the weights, syncs, then wakes the KV cache; the rollout is asleep at every
checkpoint save and load (a validation that woke it is followed by a sleep before the save); every
generation uses the actor's current weights; a load (resume, rollback) leaves the weights stale."""
import dataclasses
import json
import types

import torch
from faults import injected
from test_trn_step import FakeRollout, FakeRole, _trainer

from verl_hpc.checkpoint.sharded import ShardedTensor
from verl_hpc.engines.base import EngineState

TAGS = ("weights", "kv_cache")


class SleepyRollout(FakeRollout):
    """FakeRollout with vLLM's level-2 sleep mode: built and put to sleep (build_roles does)."""

    def __init__(self, calls, actor_engine):
        super().__init__(calls)
        self.actor_engine, self.sleeping, self.weights_dropped, self.version = actor_engine, set(TAGS), True, None

    @property
    def asleep(self):
        return bool(self.sleeping)

    def sleep(self):
        self.calls.append("sleep")
        self.sleeping, self.weights_dropped = set(TAGS), True

    def wake(self, tags=None):
        self.calls.append(f"wake({','.join(tags) if tags else 'all'})")
        self.sleeping -= set(tags or TAGS)

    def load_weights(self, weights):
        assert self.sleeping <= {"kv_cache"}, "load_weights with the weights asleep"
        self.calls.append("load_weights" if self.sleeping else "load_weights(kv_cache awake)")
        self.version = int(dict(weights)["model.w"][0, 0])
        self.weights_dropped = False

    def generate(self, prompt_ids, spec, media=None):
        assert not self.sleeping and not self.weights_dropped, (self.sleeping, self.weights_dropped)
        assert self.version == self.actor_engine.version, "generated with stale weights"
        return super().generate(prompt_ids, spec)


class VersionedEngine:
    """The actor's engine: weights = its version (bumped by every update and by a load); state()
    and load_state() record whether the rollout was asleep when they ran."""

    def __init__(self, calls):
        self.calls, self.version, self.rollout = calls, 0, None

    def export_hf_weights(self):
        yield "model.w", torch.full((2, 2), float(self.version))

    def state(self):
        self.calls.append("actor.state" + ("" if self.rollout.sleeping == set(TAGS) else " [ROLLOUT AWAKE]"))
        return EngineState([ShardedTensor("w", torch.full((2,), float(self.version)))], {"v": self.version})

    def load_state(self, load_into, meta):
        self.calls.append("actor.load" + ("" if self.rollout.sleeping == set(TAGS) else " [ROLLOUT AWAKE]"))
        slab = torch.zeros(2)
        load_into([ShardedTensor("w", slab)])
        self.version = int(slab[0]) + 100  # loaded weights differ from anything synced before


class VersionedActor(FakeRole):
    def update(self, batch, loss):
        self.engine.version += 1
        return super().update(batch, loss)


def _run(tmp_path, *overrides):
    trainer, calls, _ = _trainer(tmp_path, "algorithm.recipe=grpo", "rollout.n=2", "actor.kl_loss_coef=0.0",
                                 "actor.ppo_mini_batch_size=2", f"data.val_files=[{tmp_path}/train.jsonl]",
                                 f"checkpoint.dir={tmp_path}/ckpt", "tracking.plots=false", *overrides)
    actor = VersionedActor("actor", calls, {})
    actor.engine = VersionedEngine(calls)
    rollout = SleepyRollout(calls, actor.engine)
    actor.engine.rollout = rollout
    trainer = type(trainer)(trainer.cfg, trainer.ctx,
                            roles=dataclasses.replace(trainer.roles, actor=actor, rollout=rollout))
    trainer.ctx.preemption = types.SimpleNamespace(agreed=lambda: False)
    summary = trainer.fit()
    keep = ("sleep", "wake", "load_weights", "rollout.generate", "actor.update", "actor.state", "actor.load")
    return [c for c in calls if c.startswith(keep)], summary


SYNC = ["wake(weights)", "load_weights", "wake(kv_cache)"]  # the staged wake around the sync
STEP = ["rollout.generate", "sleep", "actor.update"]


def test_trn_lazy_sync_staged_wake_and_saves_with_the_rollout_asleep(tmp_path):
    calls, _ = _run(tmp_path, "trainer.total_steps=2", "trainer.val_every=2", "checkpoint.save_every=2")
    assert calls == [
        *SYNC, "rollout.generate",  # validation before the first step: stale from the start
        "wake(kv_cache)", *STEP,  # step 1: the weights are current (the validation synced them)
        *SYNC, *STEP,  # step 2: stale after step 1's update; nothing synced at the end of step 1
        *SYNC, "rollout.generate",  # validation after step 2
        "sleep", "actor.state",  # the save puts the rollout back to sleep first
    ]
    # resumed: the load runs with the rollout asleep and leaves the weights stale
    calls, summary = _run(tmp_path, "trainer.total_steps=3", "trainer.val_every=2", "checkpoint.save_every=2")
    assert summary["resumed_from"] == 2
    assert calls == ["sleep", "actor.load", *SYNC, *STEP, *SYNC, "rollout.generate", "sleep", "actor.state"]


def test_trn_every_step_reports_the_sync_that_served_its_generation(tmp_path):
    _run(tmp_path, "trainer.total_steps=3", "trainer.val_every=2", "tracking.backends=[jsonl]")
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if r.get("step", 0) >= 1 and "train/samples" in r}
    assert sorted(steps) == [1, 2, 3] and all(steps[s]["sync/tensors"] == 1.0 for s in steps)
    assert "timing_s/sync" not in steps[1] and "timing_s/sync" in steps[2]  # step 1's ran in validation
    assert "timing_s/sync" not in steps[3]  # step 2's validation synced the weights step 3 used


def test_trn_rollback_reloads_with_the_rollout_asleep_and_syncs_before_generating(tmp_path):
    with injected(regression_at_steps=[4]):  # a reward collapse at step 4 (tests/faults.py)
        calls, summary = _run(tmp_path, "trainer.total_steps=5", "checkpoint.save_every=1", "checkpoint.keep_last=0",
                              "trainer.rollback.enable=true", "trainer.rollback.rollback_steps=2",
                              "trainer.rollback.max_rollbacks=1")
    assert summary["steps"] == 5 and [r["to"] for r in summary["rollbacks"]] == [2]
    assert not any("AWAKE" in c for c in calls)
    load = calls.index("actor.load")
    # step 4 trips: the rollout is asleep since step 4's generation (the load's sleep is a no-op);
    # the load, then step 3 again syncs the loaded weights first
    assert calls[load - 4:load + 1 + len(SYNC) + 1] == [*STEP, "sleep", "actor.load", *SYNC, "rollout.generate"]
    assert calls.count("actor.state") == 6  # steps 1, 2, 3, then 3, 4, 5 (step 4 tripped before its save)
