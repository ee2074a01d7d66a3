"""RNG states as plain arrays, for `rank_state` (never pickled): python, numpy, torch CPU, the
accelerator's default generator (CUDA, when initialised), Megatron's named model-parallel RNG
states (its `get_cuda_rng_tracker()`: the streams dropout and weight init draw from inside
tensor-parallel regions; on CPU, cpu_compat's tracker) and any extra generators.

    rank_state = capture_rng_state(generators={"trainer": ctx.generator})
    ...
    restore_rng_state(read_rank_state(ckpt, rank), generators={"trainer": ctx.generator})

A state saved on a GPU and restored without one (or the reverse) cannot be continued exactly:
restore says so in the log and keeps the current accelerator state.
"""
from __future__ import annotations

import logging
import random
import sys
from typing import Optional

import numpy as np
import torch

from verl_hpc.runtime.device import accelerator_rng_state, has_gpu, set_accelerator_rng_state

log = logging.getLogger(__name__)

TRACKER_PREFIX = "megatron_tracker_"  # + the tracker's state name, e.g. model-parallel-rng
_TRACKER_MODULE = "megatron.core.tensor_parallel.random"


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _tracker():
    """Megatron's RNG tracker if this process has set one up (never creates one)."""
    rnd = sys.modules.get(_TRACKER_MODULE)
    if rnd is None or not getattr(rnd, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return rnd._CUDA_RNG_STATE_TRACKER


def capture_rng_state(generators: Optional[dict] = None) -> dict[str, np.ndarray]:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {
        "python_mt": np.asarray(mt, dtype=np.uint64),  # 624 words + position
        "python_meta": np.asarray([version, gauss is not None], dtype=np.int64),
        "python_gauss": np.asarray([gauss if gauss is not None else 0.0], dtype=np.float64),
        "numpy_keys": np.asarray(keys, dtype=np.uint32),
        "numpy_meta": np.asarray([pos, has_gauss], dtype=np.int64),
        "numpy_gauss": np.asarray([cached], dtype=np.float64),
        "torch_cpu": _bytes(torch.get_rng_state()),
    }
    cuda = accelerator_rng_state()  # the current device's generator, through runtime/
    if cuda is not None:
        out["torch_cuda"] = _bytes(cuda)
    tracker = _tracker()
    if tracker is not None:
        for name, state in tracker.get_states().items():
            if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8):
                # TE's CUDA-graph-safe tracker keeps generator objects, not byte states
                raise TypeError(f"checkpoint: Megatron RNG tracker state {name!r} is a "
                                f"{type(state).__name__}, not a byte tensor: cannot be saved")
            out[TRACKER_PREFIX + name] = _bytes(state)
    for name, gen in (generators or {}).items():
        out[f"generator_{name}"] = _bytes(gen.get_state())
    return out


def _byte_tensor(array) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, np.uint8))


def restore_rng_state(state: dict, generators: Optional[dict] = None) -> None:
    version, has_gauss = (int(x) for x in state["python_meta"])
    gauss = float(state["python_gauss"][0]) if has_gauss else None
    random.setstate((version, tuple(int(x) for x in state["python_mt"]), gauss))
    pos, np_has_gauss = (int(x) for x in state["numpy_meta"])
    np.random.set_state(("MT19937", np.asarray(state["numpy_keys"], np.uint32), pos, np_has_gauss,
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(_byte_tensor(state["torch_cpu"]))
    restored = "torch_cuda" in state and set_accelerator_rng_state(_byte_tensor(state["torch_cuda"]))
    if not restored and ("torch_cuda" in state or has_gpu()):
        log.warning("resume: the checkpoint's RNG states were %s a GPU and this run is %s one: "
                    "the CUDA generator is not restored (sampling continues, not bit-exactly)",
                    "saved on" if "torch_cuda" in state else "saved without",
                    "without" if "torch_cuda" in state else "on")
    saved = {k[len(TRACKER_PREFIX):]: v for k, v in state.items() if k.startswith(TRACKER_PREFIX)}
    tracker = _tracker()
    if saved and tracker is None:
        log.warning("resume: the checkpoint has Megatron RNG tracker states (%s) but this process "
                    "has no tracker yet: not restored", ", ".join(sorted(saved)))
    elif saved:
        states = dict(tracker.get_states())
        missing = sorted(set(states) - set(saved))
        if missing:
            log.warning("resume: Megatron RNG tracker states %s are not in the checkpoint: kept", missing)
        states.update({name: _byte_tensor(v) for name, v in saved.items()})
        tracker.set_states(states)
    for name, gen in (generators or {}).items():
        gen.set_state(_byte_tensor(state[f"generator_{name}"]))
