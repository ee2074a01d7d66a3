"""LoRA's weight step: the actor's adapter only, into the rollout engine's LoRA slot, verified.

    syncer = AdapterSync()                     # lora.sync = adapter (the trainer decides: trainer/stages/rollout_weights.py)
    metrics = syncer(actor, rollout)           # every rank, at the same point
    check_generated(result, syncer)            # after every generate: the adapter it used

With `lora.sync` resolving to `adapter` the rollout engine keeps the base weights it loaded at
start (the actor's base is frozen, so they never go stale) and receives only the adapter after each
update: a few MB where the merged weights are the whole model (benchmarks/bench_lora_sync.py).
The export is the engine's `export_adapter` (a collective like export_hf_weights: every rank gets
every PEFT-named tensor), taken whole by `rollout.load_adapter` (vLLM builds its LoRA model from the
tensors in memory, no files) under the actor's adapter version (its optimizer steps applied).

Verified twice: the rollout engine reports, from vLLM's own outputs, the adapter version each
generation ran with, and `check_generated` compares it with the version last synced. A rollout
that silently kept an old adapter (peers have shipped that bug: the rollout never received the
updated adapters, and training went on from a stale policy) fails the step with StaleAdapterError.
Failures of the load on one rank are agreed over all ranks as in WeightSync.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Optional

from verl_hpc.errors import VerlHpcError
from verl_hpc.resharding.sync import SyncError, _agree, held_resident

log = logging.getLogger(__name__)


class StaleAdapterError(VerlHpcError, RuntimeError):
    """The rollout generated with another adapter than the actor's last synced one."""

    exit_code, kind = 26, "stale adapter"


class AdapterSync:
    """The adapter-only sync (module docstring); `version` is the last version synced."""

    def __init__(self):
        self.version: Optional[int] = None
        self.last: Dict[str, float] = {}
        self.count = 0

    def __call__(self, actor, rollout) -> Dict[str, float]:
        engine = getattr(actor, "engine", actor)
        version = int(engine.adapter_version)
        start = time.perf_counter()
        error: Optional[BaseException] = None
        with held_resident(actor):
            tensors = list(engine.export_adapter())  # a collective: every rank runs it to the end
            export_seconds = time.perf_counter() - start
            try:
                loaded = rollout.load_adapter(tensors, engine.adapter_config(), version)
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the other ranks know)
                error = exc
        seconds = time.perf_counter() - start
        failed, slowest, first = _agree(error is not None, seconds)
        if failed:
            where = f"rank {first}" if first >= 0 else "some rank"
            detail = f" (this rank: {type(error).__name__}: {error})" if error is not None else ""
            raise SyncError(f"adapter sync of version {version} failed on {where}{detail}") from error
        self.version, self.count = version, self.count + 1
        nbytes = float(sum(t.numel() * t.element_size() for _, t in tensors))
        self.last = {"sync/seconds": slowest, "sync/bytes": nbytes,
                     "sync/gb_per_s": nbytes / max(slowest, 1e-9) / 1e9,
                     "sync/tensors": float(len(tensors)), "sync/adapter_version": float(version),
                     "sync/export_seconds": export_seconds,
                     "sync/load_seconds": float(loaded.get("seconds", seconds - export_seconds))}
        log.log(logging.INFO if self.count == 1 else logging.DEBUG,
                "adapter sync %d: version %d, %.2f MB in %d tensors in %.3f s", self.count, version,
                nbytes / 1e6, len(tensors), slowest)
        return dict(self.last)


def check_generated(result, weight_sync) -> None:
    """Raise StaleAdapterError unless `result` (a RolloutResult) was generated with the adapter
    version `weight_sync` last synced; nothing to check for a full-weight sync."""
    if not isinstance(weight_sync, AdapterSync) or weight_sync.version is None:
        return
    used = result.adapter_version
    if used != weight_sync.version:
        got = "no adapter" if used is None else f"adapter version {used}"
        raise StaleAdapterError(
            f"the rollout engine generated with {got}, but the actor's adapter version {weight_sync.version} "
            "was synced to it: it did not take the update, and training on these samples would "
            "train a stale policy. Stopping the step (lora.sync = merged avoids the LoRA slot).")

