"""The rollout engine's weights and memory phases in the RL loop: a lazy weight sync with a staged
wake, and sleep before anything makes the training engines' state resident.

    weights = RolloutWeights(roles.actor, roles.rollout, weight_sync_from_config(cfg, roles.rollout.name))
    weights.ready(timer)            # before generating: wake weights, sync if stale, wake KV cache
    metrics = weights.pop_metrics() # the step's: sync/* of the sync that served its generation
    weights.mark_stale()            # the actor's weights changed (an update, a checkpoint load)
    weights.park()                  # the rollout asleep (sleep mode): training, checkpoint save/load
    weights.check_generated(result) # LoRA adapter sync: the generation used the synced adapter

Lazy, as verl does: the rollout's weights are stale from the start of a run and after every actor
update, and are brought up to date right before they are next needed (the step's generation, a
validation), not at the end of a step, so a checkpoint saved after a step never finds vLLM's
weights and KV cache mapped beside the actor's parameters and optimizer states.

The staged wake (vLLM sleep mode; a no-op elsewhere): `wake(tags=("weights",))` maps only vLLM's
weights; the sync streams the actor's weights into them, holding the actor resident until the
rollout has loaded the last bucket (resharding.sync.held_resident), and the actor offloads when it
ends; only then `wake(tags=("kv_cache",))` maps the KV cache. The sync's peak is the actor's
parameters + vLLM's weights + one bucket, without the KV cache. Memory an offload frees goes back
to torch's caching allocator, not to the driver, and vLLM's wake maps memory of its own (CUDA's
virtual memory API, outside torch's cache): before each wake the cached blocks are released
(`runtime.device.release_cached_memory`, a no-op on CPU), or vLLM would find them taken.

A sleep at level 2 drops the weights: after the checkpoint's sleep that follows a validation, the
next generation syncs again even though the actor did not change (`rollout.weights_dropped`).

Metrics: `pop_metrics` returns the sync/* metrics of the last sync not reported yet: called by the
step after `ready`, the step's row carries the sync that served its generation, also when that
sync ran earlier (a validation's, before the first step or after the previous one).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

from verl_hpc.resharding.adapter_sync import AdapterSync, check_generated
from verl_hpc.resharding.sync import SyncError, WeightSync
from verl_hpc.rollout.recovery import EngineRecovery, agreed_faults, fault_of
from verl_hpc.rollout.engine import KV_CACHE, WEIGHTS
from verl_hpc.runtime import device as devices, faults


def weight_sync_from_config(cfg, rollout_engine: str):
    """The job's weight step: AdapterSync when lora.sync resolves to `adapter` for the job's
    (resolved) rollout engine and this rank's machine, else the full-weight WeightSync (merged
    weights under LoRA) of the resharding section."""
    if cfg.lora.syncs_adapter(cfg, rollout_engine, gpu=devices.has_gpu()):
        return AdapterSync()
    return WeightSync.from_config(cfg.resharding)


def _untimed(_stage):
    return contextlib.nullcontext()


class RolloutWeights:
    def __init__(self, actor, rollout, weight_sync, recovery: Optional[EngineRecovery] = None):
        self.actor, self.rollout, self.weight_sync = actor, rollout, weight_sync
        self.stale = True  # a run starts stale: the first generation syncs, and its step says so
        self._unreported: Dict[str, float] = {}
        # rollout.max_engine_restarts: a failed engine is rebuilt and given the current weights here
        # (rollout/recovery.py); the engine asks it when a generate failed, ready() when a sync did
        self.recovery = recovery
        if recovery is not None:
            recovery.resync = self.resync
            rollout.recovery = recovery

    def new_step(self, step: int) -> None:
        if self.recovery is not None:
            self.recovery.new_step(step)

    def pop_recovery(self) -> Dict[str, float]:
        """rollout/engine_restarts, rollout/restart_seconds, rollout/rerun_prompts of the step."""
        return self.recovery.pop_metrics() if self.recovery is not None else {}

    def resync(self) -> Dict[str, float]:
        """After a rebuild: the rollout awake with every current weight, sent the full path and read
        back where the engine serves it (the served-weights check on, whatever resharding says)."""
        r = self.rollout
        r.wake(tags=(WEIGHTS,))
        sync = self.weight_sync
        if isinstance(sync, WeightSync):
            sync = WeightSync(bucket_bytes=sync.bucket_bytes, mode="full", check_served_every=1)
        self._unreported = sync(self.actor, r)
        r.wake()
        self.stale = False
        return self._unreported

    def mark_stale(self) -> None:
        """The actor's weights changed: the next ready() syncs."""
        self.stale = True

    def unchanged(self) -> None:
        """A step that trained nothing (PRIME's warm-up): the rollout already holds these weights."""

    def ready(self, timer=None) -> None:
        """The rollout awake with the actor's current weights (module docstring). Collective
        (the sync is): every rank calls it at the same point. A wake or a sync that failed on any
        rank (the sync's own agreement, or one for the wake, tells every rank) rebuilds the engines
        and syncs the full weights again, within the recovery's bounds (rollout/recovery.py)."""
        timer = timer or _untimed
        r = self.rollout
        if self.stale or r.weights_dropped:
            with timer("wake"):
                devices.release_cached_memory()  # what the update's offload freed, back to the driver
                if not self._woken((WEIGHTS,)):  # vLLM maps its weights only
                    return  # rebuilt, synced and woken by the recovery
            with timer("sync"):  # the actor is resident for the whole sync, offloaded after it
                try:
                    self._unreported = self.weight_sync(self.actor, r)
                except SyncError as e:  # every rank together: the sync's agreement
                    if self.recovery is None:
                        raise
                    self.recovery.recover(r, [fault_of(e, rank=r.layout.rank, replica=r.layout.replica, stage="load",
                                                       agreed=True)])
                    return
            self.stale = False
        with timer("wake_kv"):
            devices.release_cached_memory()  # the sync's offload of the actor, back to the driver
            self._woken((KV_CACHE,))  # after the actor's offload: the KV cache gets its memory

    def _woken(self, tags) -> bool:
        """r.wake(tags); False where it failed on some rank and the recovery brought the engines back
        (rebuilt, synced, awake). One small collective agrees on it, only where a wake can fail (sleep
        mode on) or a test injects a fault, and only with a recovery."""
        r = self.rollout
        if self.recovery is None or not (getattr(r, "sleeps", False) or faults.active()):
            r.wake(tags=tags)
            return True
        error = None
        try:
            faults.maybe("wake")
            r.wake(tags=tags)
        except Exception as e:  # noqa: BLE001 - agreed below, then the recovery's
            error = fault_of(e, rank=r.layout.rank, replica=r.layout.replica, stage="wake")
        failed = agreed_faults(error)
        if not failed:
            return True
        self.recovery.recover(r, failed)
        return False

    def pop_metrics(self) -> Dict[str, float]:
        """sync/* of the last sync, once (module docstring); {} when it was reported already."""
        out, self._unreported = self._unreported, {}
        return out

    def check_generated(self, result) -> None:
        """The weight step's check of a generation (LoRA adapter sync: the adapter version the
        rollout reports it used must be the one synced; StaleAdapterError otherwise)."""
        check_generated(result, self.weight_sync)

    def park(self) -> None:
        """The rollout asleep (a no-op without sleep mode): before training, and before a
        checkpoint's save or load makes the engines' parameters and optimizer states resident."""
        self.rollout.sleep()
