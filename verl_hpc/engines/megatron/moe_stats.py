"""Per-step router statistics of a mixture-of-experts actor: expert load per layer, dropped tokens,
and the router's load-balancing and z-losses (which Megatron adds to the objective itself).

    stats = RouterStats(gpt_chunks, arch)     # hooks on every router of this rank's stages
    stats.reset()                             # before the step's forward-backward
    metrics.update(stats.metrics(device))     # after it: collective over the whole world

The counts stay on the routers' device until `metrics` (no host sync per micro-batch); `device` is
where the one reduction of the step runs (the engine's collective device: NCCL needs the GPU).

Each router's forward output `(probs, routing_map)` (routing_map [tokens, E], True where a token
goes to an expert, after any capacity drop) is counted per layer. Counts are summed over the data-
parallel ranks (different tokens) and taken from TP rank 0 only (its TP peers route the same
tokens); every pipeline stage contributes its own layers. Metrics, per step:

    moe/load_imbalance          mean over layers of max_e load / mean_e load (1 = balanced; E = all
                                tokens to one expert)
    moe/layer_{L}/load_imbalance, moe/layer_{L}/load_max_share   the same per layer, and the
                                busiest expert's share of the layer's routed tokens
    moe/ep_rank_share/{r}       share of the routed token copies that land on expert-parallel rank
                                r's experts (its all-to-all receives; 1 / ep = balanced); ep > 1
    moe/dropped_fraction        token-expert assignments dropped by the capacity factor (0 when
                                dropless, model.moe_capacity_factor null)
    moe/aux_loss, moe/z_loss    Megatron's tracked load-balancing / z-loss, unscaled (before the
                                coefficient), mean over layers and micro-batches
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist


class RouterStats:
    def __init__(self, gpt_chunks, arch):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        self.arch, self.moe = arch, arch.moe
        self.layers = arch.num_layers
        self.counting = ps.get_tensor_model_parallel_rank() == 0
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.ep = ps.get_expert_model_parallel_world_size()
        self.counts = torch.zeros(self.layers, self.moe.num_experts, dtype=torch.float64)  # moved to the routers' device
        self.assigned = 0  # token copies offered to the routers (tokens x top_k, summed over layers)
        self.microbatches = 0
        routed = [(layer.layer_number - 1, layer.mlp.router) for chunk in gpt_chunks
                  for layer in chunk.decoder.layers if isinstance(getattr(layer.mlp, "router", None), TopKRouter)]
        # one forward of this rank's first MoE layer = one micro-batch
        self._first_layer = min((n for n, _ in routed), default=-1)
        for number, router in routed:
            router.register_forward_hook(self._hook(number))

    def _hook(self, layer: int):
        def count(module, args, output):
            if not self.counting:
                return
            _, routing_map = output
            if self.counts.device != routing_map.device:
                self.counts = self.counts.to(routing_map.device)
            self.counts[layer] += routing_map.detach().sum(dim=0, dtype=torch.float64)
            self.assigned += routing_map.shape[0] * self.moe.top_k
            if layer == self._first_layer:
                self.microbatches += 1

        return count

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        self.assigned = 0
        self.microbatches = 0
        clear_aux_losses_tracker()

    def _tracked(self) -> List[float]:
        """This rank's sums of Megatron's tracked losses over its layers and micro-batches."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        out = []
        for name in ("load_balancing_loss", "z_loss"):
            values = tracker.get(name, {}).get("values")
            out.append(float(values.sum()) if values is not None and self.counting else 0.0)
        return out

    def metrics(self, device=None) -> Dict[str, float]:
        """The step's statistics (module docstring); collective over the whole world."""
        aux, z = self._tracked()
        device = self.counts.device if device is None else device
        tail = torch.tensor([float(self.assigned), aux, z, float(self.microbatches)], dtype=torch.float64)
        vec = torch.cat([self.counts.flatten().to(device), tail.to(device)])
        if not self.counting:
            vec.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
        vec = vec.cpu()  # one transfer
        counts = vec[: self.counts.numel()].view(self.layers, -1)
        assigned, aux, z, microbatches = vec[self.counts.numel():].tolist()
        out: Dict[str, float] = {}
        imbalances = []
        for layer in range(self.layers):
            row = counts[layer]
            total = float(row.sum())
            if total <= 0:
                continue
            imbalance = float(row.max()) / (total / row.numel())
            imbalances.append(imbalance)
            out[f"moe/layer_{layer}/load_imbalance"] = imbalance
            out[f"moe/layer_{layer}/load_max_share"] = float(row.max()) / total
        if imbalances:
            out["moe/load_imbalance"] = sum(imbalances) / len(imbalances)
        total = float(counts.sum())
        if self.ep > 1 and total > 0:
            per_rank = counts.sum(dim=0).view(self.ep, -1).sum(dim=1)
            out.update({f"moe/ep_rank_share/{r}": float(v) / total for r, v in enumerate(per_rank)})
        # every stage offers its layers the same tokens: assignments per layer = assigned / stages'
        # layers counted, i.e. dropped = 1 - routed / offered over all layers
        offered = assigned
        routed = float(counts.sum())
        out["moe/dropped_fraction"] = max(0.0, 1.0 - routed / offered) if offered > 0 else 0.0
        # aux and z are summed over each stage's layers and micro-batches; microbatches over the
        # stages' first layers: per (layer, micro-batch) = sum * pp / (microbatches * layers)
        if microbatches > 0:
            per = self.pp / (microbatches * self.layers)
            out["moe/aux_loss"] = aux * per
            if z:
                out["moe/z_loss"] = z * per
        return out
