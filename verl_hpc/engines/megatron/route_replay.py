"""Routing replay on the Megatron engine: training forwards route each token to given experts.

megatron-core 0.16.1 builds a `RouterReplay` in every `TopKRouter` when the TransformerConfig sets
`moe_enable_routing_replay` (transformer/moe/router_replay.py). Its top-k step then asks the
instance: RECORD (route, and keep the indices), REPLAY_FORWARD (take `target_topk_idx` and gather
the router's scores at those experts, so the gate weights stay differentiable), or nothing. This
module drives those instances per micro-batch, from the batch's `routed_experts` [B, S, L, k]
(verl_hpc.models.moe_routes), with one addition of its own (`_Replay`): a position whose route is
MISSING (padding, a sequence's last token) takes the router's own choice, and the router's own
choice is kept beside the replayed one, which gives the agreement metric at no extra forward.

    replay = RouteReplay(gpt_chunks, arch)          # on the engine's own routers (not Megatron's
                                                    # global list: a second model keeps its own)
    replay.begin(batch, record=False)               # replay the batch's routes (if it has them)
    run_schedule(..., replay=replay)                # before(mb) / after(mb) around each forward
    replay.routes(device)                           # record=True: [B, S, L, k] of this forward
    replay.metrics(device)                          # moe/route_agreement[/layer_L]

Token order: the model takes `[b, s]` ids and routes `[s, b]` hidden states flattened, so a
micro-batch's targets are its routes transposed to sequence-major. Each token's route is set on
every rank that routes it: TP peers route the same tokens (no sequence parallelism: the config
refuses it with replay, as context parallelism), EP and DP ranks their own rows, each pipeline
stage its own layers. The agreement counts come from TP rank 0 and are summed over the world.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist

from verl_hpc.models.moe_routes import fit_rows, fit_width, missing_value, route_dtype

KEY = "routed_experts"


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class _Replay(RouterReplay):
        """Megatron's replay, but MISSING targets (< 0) route freely, and the router's own top-k is
        recorded while replaying (the agreement metric)."""

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            _, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.record_indices(natural)
            target = self.target_topk_idx.to(scores.device)
            chosen = torch.where(target < 0, natural, target)
            return scores.gather(1, chosen), chosen

    return _Replay, RouterReplay, RouterReplayAction


class RouteReplay:
    def __init__(self, gpt_chunks, arch):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        replay_cls, base, self._action = _replay_class()
        self.layers, self.top_k = arch.num_layers, arch.moe.top_k
        self.dtype = route_dtype(arch.moe.num_experts)
        self.counting = ps.get_tensor_model_parallel_rank() == 0
        self.routers: Dict[int, torch.nn.Module] = {}
        for chunk in gpt_chunks:
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if not isinstance(router, TopKRouter) or router.router_replay is None:
                    continue
                if router.router_replay in base.global_router_replay_instances:
                    base.global_router_replay_instances.remove(router.router_replay)
                router.router_replay = replay_cls()
                base.global_router_replay_instances.remove(router.router_replay)
                self.routers[layer.layer_number - 1] = router
        if not self.routers and arch.moe is not None and gpt_chunks:
            raise RuntimeError("routing replay: the model's routers were built without "
                               "moe_enable_routing_replay (models/moe.transformer_overrides)")
        self.record = False
        self._buffer: Optional[torch.Tensor] = None
        self._agree = torch.zeros(self.layers, dtype=torch.float64)
        self._slots = torch.zeros(self.layers, dtype=torch.float64)

    # ------------------------------------------------------------------ per forward
    def begin(self, batch: Mapping[str, torch.Tensor], record: bool) -> None:
        """Before a schedule: replay the batch's routes (where it has them), or with `record` keep
        the routes this forward takes (the batch must then have none)."""
        self.record = record
        self._buffer = None
        if record:  # +1 so that 0 marks "not written here" in the SUM over ranks
            b, s = batch["input_ids"].shape
            self._buffer = torch.zeros(b, s, self.layers, self.top_k, dtype=torch.int32)

    def before(self, mb) -> None:
        """Set every router's action (and targets) for micro-batch `mb`'s forward."""
        routes = None if mb.dummy else mb.model_routes
        for layer, router in self.routers.items():
            replay = router.router_replay
            if self.record and not mb.dummy:
                replay.set_router_replay_action(self._action.RECORD)
            elif routes is not None:
                replay.clear_indices()
                replay.set_target_indices(self._targets(routes, layer, mb.model_input_ids.shape))
                replay.set_router_replay_action(self._action.REPLAY_FORWARD)
            else:
                replay.clear_router_replay_action()

    def _targets(self, routes: torch.Tensor, layer: int, shape) -> torch.Tensor:
        """Layer `layer`'s routes of the micro-batch as Megatron's router sees its tokens:
        `[s * b, k]` long, sequence-major; MISSING -> -1."""
        rows, seq = shape
        r = fit_rows(fit_width(routes, seq), rows)[:, :, layer]
        missing = r == missing_value(r.dtype)
        t = r.long().masked_fill(missing, -1)
        return t.transpose(0, 1).reshape(seq * rows, -1)

    def after(self, mb) -> None:
        """After `mb`'s forward on this stage: its agreement counts, or its recorded routes."""
        if mb.dummy or not self.counting:
            return
        rows, seq = mb.model_input_ids.shape
        n = rows if mb.packed else mb.real_rows  # a packed row holds a prompt's samples
        for layer, router in self.routers.items():
            replay = router.router_replay
            got = replay.get_recorded_indices()
            if got is None:
                continue
            # [n, seq, k] where the router ran: the records and counts stay there, read once per
            # forward (routes(), metrics()), not per layer and micro-batch (each read a GPU sync)
            got = got.detach().reshape(seq, rows, -1).transpose(0, 1)[:n]
            if self.record:  # never packed (MegatronEngine.forward): row j is sample mb.rows[j]
                if self._buffer.device != got.device:
                    self._buffer = self._buffer.to(got.device)
                index = torch.as_tensor(mb.rows, dtype=torch.long, device=got.device)
                width = min(seq, self._buffer.shape[1])
                self._buffer[index, :width, layer] = got[:, :width].to(torch.int32) + 1
            elif replay.target_topk_idx is not None:
                target = replay.target_topk_idx.reshape(seq, rows, -1).transpose(0, 1)[:n].to(got.device)
                valid = (target >= 0).all(-1)  # [n, seq]
                match = (got.unsqueeze(-1) == target.unsqueeze(-2)).any(-1).sum(-1)  # [n, seq]
                if self._agree.device != got.device:
                    self._agree, self._slots = self._agree.to(got.device), self._slots.to(got.device)
                self._agree[layer] += match[valid].sum()
                self._slots[layer] += valid.sum() * self.top_k
            replay.clear_indices()

    def finish(self) -> None:
        """After a schedule: every router routes freely again (exports, other forwards)."""
        for router in self.routers.values():
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    # ------------------------------------------------------------------ results
    def routes(self, batch: Mapping[str, torch.Tensor], device) -> torch.Tensor:
        """The recorded forward's routes `[B, S, L, k]` on every rank (one SUM all-reduce: rows,
        layers and ranks are disjoint), MISSING from each sequence's last token on."""
        buf = self._buffer.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(buf)
        buf = buf.cpu() - 1
        length = (batch["prompt_lengths"] + batch["response_lengths"]).cpu()
        beyond = torch.arange(buf.shape[1]).unsqueeze(0) >= (length - 1).unsqueeze(1)
        buf[beyond] = -1
        missing = buf < 0
        out = buf.clamp(min=0).to(self.dtype)
        out[missing] = missing_value(self.dtype)
        self._buffer = None
        return out

    def metrics(self, device) -> Dict[str, float]:
        """moe/route_agreement/layer_{L} and their mean: the share of replayed (token, slot) pairs
        the router would have chosen itself, since the last call. {} when nothing was replayed."""
        counts = torch.stack([self._agree, self._slots]).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        agree, slots = counts.cpu()
        self._agree.zero_()
        self._slots.zero_()
        if float(slots.sum()) == 0:
            return {}
        out = {f"moe/route_agreement/layer_{layer}": float(agree[layer] / slots[layer])
               for layer in range(self.layers) if slots[layer] > 0}
        out["moe/route_agreement"] = float(agree.sum() / slots.sum())
        return out
