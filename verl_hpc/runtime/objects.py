"""Python objects from one rank to all: what rank 0 alone knows (the sampled prompts, tool output,
a wall-clock decision) must reach every rank identically, or the collectives that follow diverge."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (a no-op without torch.distributed or with one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
