"""Routing replay's record side in HF generate: each fed token's top-k experts per MoE layer.

transformers 5's MoE routers (`model.layers.{i}.mlp.gate` of Mixtral, Qwen2-MoE, Qwen3-MoE) return
(logits, scores, indices [tokens, k]) for the block's flattened `[b, s, hidden]` input. A hook on
each block records its input's (b, s) and one on its router the indices, so a generate call
leaves, per layer, one `[b, s, k]` chunk per forward in call order: the shared prefill (one row
per prompt), then the decode steps (one row per sample). Joined along the sequence, chunk t covers
the columns that forward fed: position p of the left-padded sequence is fed exactly once, except
the last sampled token, which no forward sees (its route is MISSING: models/moe_routes.py).
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

from verl_hpc.models.moe_routes import route_dtype

_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


class RouteRecorder:
    """Hooks on an HF MoE model's routers; `recording()` around a generate call, then `routes(rows)`."""

    def __init__(self, model: torch.nn.Module):
        config = model.config.get_text_config()
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        routers = {int(m.group(1)): module for name, module in model.named_modules()
                   if (m := _ROUTER.match(name))}
        if not routers or not experts:
            raise ValueError(f"routing replay: {type(model).__name__} has no MoE routers to record")
        self.layers = sorted(routers)
        self.dtype = route_dtype(int(experts))
        self._chunks: Dict[int, List[torch.Tensor]] = {}
        self._shape: Dict[int, Tuple[int, int]] = {}
        self.active = False
        modules = dict(model.named_modules())
        for layer, router in routers.items():
            modules[f"model.layers.{layer}.mlp"].register_forward_pre_hook(self._shape_hook(layer))
            router.register_forward_hook(self._index_hook(layer))

    def _shape_hook(self, layer: int):
        def hook(module, args):
            if self.active:
                self._shape[layer] = tuple(args[0].shape[:2])
        return hook

    def _index_hook(self, layer: int):
        def hook(module, args, output):
            if self.active:
                b, s = self._shape[layer]
                self._chunks[layer].append(output[2].reshape(b, s, -1).to("cpu", self.dtype))
        return hook

    def start(self) -> None:
        self._chunks = {layer: [] for layer in self.layers}
        self.active = True

    def stop(self) -> None:
        self.active = False

    def joined(self, rows: int, fed: int) -> torch.Tensor:
        """`[rows, fed, L, k]`: every forward's chunk, prompt rows repeated to the sample rows (the
        shared prefill ran once per prompt), joined along the sequence."""
        per_layer = []
        for layer in self.layers:
            parts = [c.repeat_interleave(rows // c.shape[0], 0) if c.shape[0] != rows else c
                     for c in self._chunks[layer]]
            joined = torch.cat(parts, dim=1)
            if joined.shape[1] != fed:  # a generate that fed tokens otherwise than assumed above
                raise RuntimeError(f"routing replay: layer {layer} routed {joined.shape[1]} positions, "
                                   f"expected {fed} (prompt width + generated tokens - 1)")
            per_layer.append(joined)
        self._chunks = {layer: [] for layer in self.layers}
        return torch.stack(per_layer, dim=2)
