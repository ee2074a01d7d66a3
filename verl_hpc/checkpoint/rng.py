"""RNG states as plain arrays, for `rank_state` (never pickled): python, numpy, torch CPU, generators.

    rank_state = capture_rng_state(generators={"trainer": ctx.generator})
    ...
    restore_rng_state(read_rank_state(ckpt, rank), generators={"trainer": ctx.generator})

Accelerator RNG states (CUDA) are the engine's to add, through the runtime's device layer, as
uint8 arrays like `torch_cpu` here.
"""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch


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
        "torch_cpu": torch.get_rng_state().numpy().copy(),
    }
    for name, gen in (generators or {}).items():
        out[f"generator_{name}"] = gen.get_state().numpy().copy()
    return out


def restore_rng_state(state: dict, generators: Optional[dict] = None) -> None:
    version, has_gauss = (int(x) for x in state["python_meta"])
    gauss = float(state["python_gauss"][0]) if has_gauss else None
    random.setstate((version, tuple(int(x) for x in state["python_mt"]), gauss))
    pos, np_has_gauss = (int(x) for x in state["numpy_meta"])
    np.random.set_state(("MT19937", np.asarray(state["numpy_keys"], np.uint32), pos, np_has_gauss,
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(state["torch_cpu"], np.uint8)))
    for name, gen in (generators or {}).items():
        gen.set_state(torch.from_numpy(np.ascontiguousarray(state[f"generator_{name}"], np.uint8)))
