"""`FsdpEngine`: any Hugging Face model, as transformers builds it, sharded with FSDP2 behind
`TrainingEngine` (verl_hpc/engines/base.py): the same contract as the Megatron engine.

    eng = FsdpEngine(options)                       # EngineOptions with engine = "fsdp"
    out = eng.forward(batch)                        # {"log_probs", "entropy"}: [B, T]
    metrics = eng.train_step(batch, loss_fn, outputs=("log_probs",))

Every rank is a data-parallel rank (the mesh's shard and replicate dims together): it takes its
rows of the whole batch by the same plan as the Megatron engine (verl_hpc/engines/partition.py:
fixed micro-batches or a token budget, equal micro-batch counts on every rank, empty micro-batches
run as a zero-contribution dummy so that every rank enters every all-gather). Each micro-batch's
loss is its contribution to the full-batch loss (the loss-contribution rule, GlobalCounts), its
gradients are summed over micro-batches and ranks (FSDP's divide factor is 1: build.py), so the
update does not depend on the split. Rows the loss names as adding nothing
(`rows_without_gradient`) are left out, with the counts of the whole batch.

Outputs (scoring.py): the causal LM's log-probs, entropy and sum-pi-squared at the scored tokens,
from the output layer in chunks (head.py) or from the whole logits of the scored positions; value
heads give per-position values. Checks of the options: build.check_fsdp_options; the weight stream
(sync, save_hf): export.py, this rank's shards for the sliced sync: holdings.py.

Prompt sharing (`share_prompts`, engines/prefix.py): one model row per prompt with its responses
after it, each response seeing the prompt and its own tokens at the positions of its own sequence,
through a dense 4D attention mask that transformers hands to SDPA as it is (`sharing.py`). Where
the mask costs more than the repeated prompts save (the cost model), a micro-batch stays one
sequence per row.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.base import (EngineState, GlobalCounts, LossFn, TrainingEngine, scaler_metrics,
                                   skipped_for_overflow)
from verl_hpc.engines.batch import check_batch, get_response_mask, response_width
import verl_hpc.engines.fsdp.build as build_lib
from verl_hpc.engines.fsdp.build import check_fsdp_options
from verl_hpc.engines.fsdp.export import hf_weights
import verl_hpc.engines.fsdp.optim as optim_lib
from verl_hpc.engines.fsdp.head import chunked_head
from verl_hpc.engines.fsdp.liger import setup_liger
from verl_hpc.engines.fsdp.microbatch import MicroBatch
from verl_hpc.engines.fsdp.scoring import score
from verl_hpc.engines.fsdp.state import Coords, engine_state, load_engine_state
from verl_hpc.engines.logits import pending_adam_bytes
from verl_hpc.engines.offload import Offloader
from verl_hpc.engines.options import EngineOptions
from verl_hpc.engines.outputs import gather_outputs, metrics_from_sums, sum_over_ranks
from verl_hpc.engines.prefix import rank_microbatches
from verl_hpc.engines.fsdp.sharing import prompt_sharing
import verl_hpc.engines.fsdp.ulysses as ulysses
from verl_hpc.engines.roles import rows_to_run
from verl_hpc.models.moe import fused_experts
from verl_hpc.runtime.attention import trains_with_torch_attention
from verl_hpc.runtime.device import collective_device

log = logging.getLogger(__name__)


# Why one rank: FSDP reduces the gradients of the parameters that received one, and a rank whose
# micro-batch holds no image gives the vision tower none, so the ranks' reductions would differ.
TOWER_RANKS = ("vision.train_vision_tower = true trains on one rank only (a micro-batch without images "
               "leaves the tower without a gradient on its rank, and FSDP's reduction needs the same "
               "tensors on every rank); keep the tower frozen (false) on more ranks")


class FsdpEngine(TrainingEngine):
    def __init__(self, options: EngineOptions, field: str = "model.path"):
        if not dist.is_initialized():
            raise RuntimeError("FsdpEngine needs the rank runtime: call verl_hpc.runtime.bootstrap() first")
        check_fsdp_options(options)
        self.options = o = options
        self.default_outputs = ("log_probs", "entropy") if o.head == "lm" else ("values",)
        self.device = collective_device()
        self.compute_dtype = build_lib.compute_dtype(o.fsdp, o.dtype)
        model, full = build_lib.load_model(o, field)
        self.liger = setup_liger(model, o)  # Liger's fused kernels where they run (liger.py); said once
        self.hf_config = model.config
        self.vision = build_lib.is_vision_model(self.hf_config)
        # fsdp.sp > 1: groups of sp ranks share each sequence (ulysses.py); a data-parallel rank
        # is then a group, and every rank of it runs the same micro-batches
        self.sp = ulysses.setup(o, model, self.vision) if o.fsdp.sp > 1 else None
        sp = o.fsdp.sp
        self.dp, self.dp_rank = dist.get_world_size() // sp, dist.get_rank() // sp
        self.image_token_id = getattr(self.hf_config, "image_token_id", None)
        self.architecture = build_lib.describe(model)
        self.coords = Coords.for_model(self.hf_config.to_dict())
        self.lora = None
        if o.lora is not None:
            from verl_hpc.engines.fsdp.lora import attach_adapters

            model, full, self.lora = attach_adapters(model, full, o)
        self.mesh = build_lib.make_mesh(o.fsdp, self.device)
        build_lib.shard_model(model, self.mesh, o.fsdp, self.compute_dtype,
                              activation_checkpointing=o.fsdp.activation_checkpointing and o.trainable)
        build_lib.materialize(model, full, build_lib.param_home(o.fsdp, self.device))
        del full
        self.model = model
        self.optimizer = self.scheduler = self.scaler = None
        if o.trainable:
            if self.lora is None:
                for p in model.parameters():
                    p.requires_grad_(True)
                if self.vision and o.train_vision_tower and self.dp > 1:
                    raise ConfigError(TOWER_RANKS)
                if self.vision and not o.train_vision_tower:  # frozen: no gradient, no optimizer state
                    for m in build_lib.vision_modules(model):
                        m.requires_grad_(False)
            self.optimizer = optim_lib.build_optimizer(model, o.optim, fused=self.compute_dtype != torch.float16)
            self.scheduler = optim_lib.LRSchedule(self.optimizer, o.optim, o.total_steps)
            self.scaler = optim_lib.loss_scaler(o.optim, self.compute_dtype, self.device)
        else:
            for p in model.parameters():
                p.requires_grad_(False)
        # a VLM's rows are never packed: the image tokens' M-RoPE positions are the model's own layout
        # nor under sequence parallelism: the regrouped attention is causal over plain rows
        self._sharing = None if self.vision or self.sp else prompt_sharing(o, self.hf_config, model)
        self._head = chunked_head(model, o, self.liger)  # scored tokens without the whole logits (head.py)
        if self._head is not None:
            self._head.pending = self._pending_state_bytes
        self.steps_applied = 0
        self._stepped_since_schedule = False  # scheduler_step advances only after an applied step
        self._view = None  # the sliced sync's holdings view (exported_model)
        self._skipped: Optional[Dict[str, float]] = None
        self.offloader = Offloader(self, params=o.param_offload,
                                   optimizer=o.optimizer_offload and o.trainable)
        self.offloader.offload()
        if dist.get_rank() == 0:
            log.info("FSDP engine (%s head): %s, %.1f M parameters over %s, compute %s%s%s", o.head,
                     self.architecture, build_lib.parameter_count(model) / 1e6, self.mesh,
                     str(self.compute_dtype).replace("torch.", ""),
                     ", activation checkpointing" if o.fsdp.activation_checkpointing else "",
                     f", sequence parallel {sp} (Ulysses; {self.dp} data-parallel groups)" if self.sp else "")

    def offload_tensors(self) -> Dict[str, list]:
        """What the offloader moves (engines/offload.py): the local shards of the parameters and
        of Adam's moments. Gradients are not moved: each update sets them to None before its
        backward, and with grad_offload train_step frees them after its step (an idle role would
        otherwise hold 4 bytes per parameter / shard)."""
        params = [_local(p) for p in self.model.parameters()]
        opt = []
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                opt += [_local(v) for v in st.values() if isinstance(v, torch.Tensor)]
        return {"params": params, "grads": [], "optimizer": opt}

    def _pending_state_bytes(self) -> int:
        """Adam's state not yet created that later steps hold on the device at the output layer
        (logits.pending_adam_bytes): none while it is offloaded outside an update."""
        if self.optimizer is None or (self.options.optimizer_offload and not torch.is_grad_enabled()):
            return 0
        return pending_adam_bytes([self.optimizer])

    def resident(self, what: str = "train"):
        """Context: offloaded states back on the device (forward | state | train)."""
        return self.offloader.resident(what)

    # ------------------------------------------------------------------ names

    def hf_named_parameters(self) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        """(HF name, parameter): the names the model's own folder uses (a value model's backbone
        under `model.`, its head `score.weight`); tied weights once."""
        if self.lora is not None:
            from verl_hpc.engines.fsdp.lora import base_names

            yield from base_names(self.model)
            return
        yield from self.model.named_parameters()

    # ------------------------------------------------------------------ running

    def _microbatches(self, batch, rows: Optional[List[int]] = None) -> List[MicroBatch]:
        """This rank's micro-batches of `rows` (default: all), planned as the Megatron engine
        plans them: with prompt sharing and a token budget, a prompt's responses stay together."""
        rows = list(range(batch["input_ids"].shape[0])) if rows is None else rows
        share = self.sp.size if self.sp is not None else 1  # a group's budget: each rank holds 1/sp of it
        mine = rank_microbatches(batch, rows, self.dp, self.dp_rank, micro_batch_size=self.options.micro_batch_size,
                                 max_tokens=self.options.max_tokens_per_microbatch * share,
                                 share_prompts=self._sharing is not None)
        return [MicroBatch(batch, mb, self.device, self._sharing, self.image_token_id, self.sp) for mb in mine]

    def _run(self, mb: MicroBatch, want: Sequence[str]) -> Dict[str, torch.Tensor]:
        """The model on one micro-batch -> outputs `[b, T]` (or `[b]`), with grad if enabled (scoring.py)."""
        return score(self, mb, want)

    @trains_with_torch_attention  # runtime/attention.py: torch's SDPA choice, whatever vLLM set
    def forward(self, batch, outputs=None) -> Dict[str, torch.Tensor]:
        check_batch(batch, need_response=False)
        want = tuple(outputs or self.default_outputs)
        self.model.eval()
        collected = []
        with torch.no_grad(), self.resident("forward"):
            for mb in self._microbatches(batch):
                out = self._run(mb, want)
                if not mb.dummy:
                    collected.append((mb, {k: v.detach() for k, v in out.items()}))
            self._reshard()
        # a sequence-parallel group holds its rows' outputs on every rank: one of them reports
        return gather_outputs(collected, batch["input_ids"].shape[0], response_width(batch), want,
                              self.device, reporting=self.sp is None or self.sp.rank == 0)

    def _reshard(self) -> None:
        """Shard the weights a no-grad forward left gathered. With fsdp.reshard_after_forward =
        false FSDP2 keeps each unit's full weights after its forward for the backward, and only
        the backward reshards them: after a forward without one the modules would hold those
        plain full tensors, not the sharded parameters that the optimizer, the state slabs and
        the offloader hold (and they would stay gathered until the next update)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def global_counts(self, batch) -> GlobalCounts:
        mask = get_response_mask(batch)
        norm = self.options.loss_norm_len or float(mask.shape[1])
        return GlobalCounts(tokens=float(mask.sum()), seqs=float(mask.shape[0]), norm_len=norm)

    def forward_backward(self, batch, loss_fn: LossFn, outputs: Sequence[str] = ()) -> List[dict]:
        """Gradients of the whole batch's loss into the sharded grads (no optimizer step);
        returns this rank's per-micro-batch records."""
        if self.optimizer is None:
            raise RuntimeError("this engine is frozen (reference / reward model): no training")
        check_batch(batch)
        rows, self._skipped = rows_to_run(batch, loss_fn)
        counts = dataclasses.replace(self.global_counts(batch),
                                     run_tokens=float(get_response_mask(batch)[rows].sum()))
        mbs = self._microbatches(batch, rows)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        want = tuple(outputs) or self.default_outputs[:1]
        records = []
        for mb in mbs:
            out = self._run(mb, want)
            if mb.dummy:
                loss, metrics = sum(v.sum() for v in out.values()) * 0.0, {}
            else:
                loss, metrics = loss_fn(out, mb.data, counts)
            # fp16: the backward runs on the scaled loss; the step unscales (optim.guarded_step)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            # the ranks of a sequence-parallel group compute the same loss: each records 1/sp of it
            share = 1.0 / (self.sp.size if self.sp is not None else 1)
            records.append({"loss": loss.detach().float() * share, "tokens": mb.tokens * share,
                            **{k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}})
        self._num_microbatches = len(mbs)
        # under sequence parallelism: the rows x padded lengths the group ran (each rank holds
        # 1/sp of them), what the all-to-alls move (benchmarks/scaling_formulas.py)
        self._sp_tokens = sum(mb.input_ids.numel() for mb in mbs) * self.sp.size if self.sp else 0
        self._packed_microbatches = sum(mb.packed for mb in mbs)
        return records

    @trains_with_torch_attention  # runtime/attention.py: torch's SDPA choice, whatever vLLM set
    def train_step(self, batch, loss_fn: LossFn, outputs: Sequence[str] = ()) -> Dict[str, float]:
        with self.resident("train"):
            records = self.forward_backward(batch, loss_fn, outputs)
            sums, keys = metric_sums(records)
            scale = self._loss_scale()  # the scale this backward used (fp16)
            # the metric sums are read with the gradient norm: one host read before the step
            applied, norm, found_inf, vals = optim_lib.guarded_step(
                self.model, self.optimizer, self.options.optim.clip_grad, sums, self.scaler)
            metrics = metrics_from_sums(vals, keys)
            if self.options.grad_offload:  # dropped while idle, as the Megatron engine's grad buffers
                self.optimizer.zero_grad(set_to_none=True)
        self.steps_applied += int(applied)
        self._stepped_since_schedule |= applied
        overflow = skipped_for_overflow(applied, found_inf, metrics["loss"], scale, self.options.optim)
        metrics.update(grad_norm=norm, lr=optim_lib.current_lr(self.optimizer),
                       nonfinite=0.0 if applied or overflow else 1.0,
                       **scaler_metrics(overflow, self._loss_scale()),
                       num_microbatches=float(self._num_microbatches),
                       packed_microbatches=float(self._packed_microbatches),
                       **({"sp_padded_tokens": self._sp_padded_tokens()} if self.sp else {}),
                       **(self._skipped or {}))
        if overflow:
            log.info("fp16 loss scale %g overflowed: optimizer step skipped, scale now %g", scale,
                     metrics["loss_scale"])
        elif not applied:
            log.warning("non-finite loss %.4g or grad norm %.4g: optimizer step skipped", metrics["loss"], norm)
        return metrics

    def _loss_scale(self) -> Optional[float]:
        return None if self.scaler is None else float(self.scaler.get_scale())

    def _sp_padded_tokens(self) -> float:
        """The step's rows x padded lengths over all sequence-parallel groups (each group's ranks
        count theirs once: / sp), the same on every rank as every metric."""
        total = torch.tensor([float(self._sp_tokens)], dtype=torch.float64, device=collective_device())
        dist.all_reduce(total)
        return float(total) / self.sp.size

    def _reduce_metrics(self, records: List[dict]) -> Dict[str, float]:
        """Loss = the sum of contributions; the loss's metrics = token-weighted means."""
        sums, keys = metric_sums(records)
        return metrics_from_sums(sums.tolist(), keys)

    def scheduler_step(self) -> float:
        """One trainer step of the LR schedule, if an optimizer step was applied since the last
        call (base.py)."""
        if self.scheduler is None:
            return 0.0
        if self._stepped_since_schedule:
            self.scheduler.step(1)
        self._stepped_since_schedule = False
        return optim_lib.current_lr(self.optimizer)

    @property
    def lr(self) -> float:
        return optim_lib.current_lr(self.optimizer) if self.optimizer is not None else 0.0

    # ------------------------------------------------------------------ weights and state

    @property
    def exported_model(self):
        """For the sliced weight sync (verl_hpc.resharding.sync): a context giving this rank's
        shards as a holdings view (holdings.py); None under LoRA, whose merged weights exist
        only gathered (the sync then takes the full path or the adapter-only one)."""
        # a fused-expert MoE model's parameters are not its checkpoint's tensors: the full path splits them
        return None if self.lora is not None or fused_experts(self.model) else self._holdings

    @contextlib.contextmanager
    def _holdings(self):
        from verl_hpc.engines.fsdp.holdings import FsdpHoldings

        if self._view is None:  # one view for the engine's life: the sync keeps its plan per view
            self._view = FsdpHoldings(self)
        with self.resident("forward"):
            yield self._view

    def export_hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(HF name, full tensor) on every rank, one parameter at a time, in the checkpoint's names,
        then the persistent buffers; under LoRA the merged weights (export.py)."""
        with self.resident("forward"):
            yield from hf_weights(self)

    def state(self) -> EngineState:
        if not self.offloader.any:
            return engine_state(self)
        with self.resident("state"):
            st = engine_state(self)
            tensors = [dataclasses.replace(t, local=t.local.detach().to("cpu", copy=True)) for t in st.tensors]
        return dataclasses.replace(st, tensors=tensors)

    def load_state(self, load_into: Callable[[Sequence[Any]], None], meta: Mapping[str, Any]) -> None:
        with self.resident("state"):
            load_engine_state(self, load_into, meta)

    # ------------------------------------------------------------------ LoRA (engines/fsdp/lora.py)

    def adapters_off(self):
        if self.lora is None:
            return contextlib.nullcontext()
        return self.model.disable_adapter()

    @property
    def adapter_version(self) -> int:
        return self.steps_applied

    def adapter_config(self) -> dict:
        from verl_hpc.engines.fsdp.lora import adapter_config

        return adapter_config(self)

    def export_adapter(self) -> Iterator[Tuple[str, torch.Tensor]]:
        from verl_hpc.engines.fsdp.lora import export_adapter

        with self.resident("forward"):
            yield from export_adapter(self)

    def lora_meta(self) -> dict:
        from verl_hpc.engines.fsdp.lora import state_meta

        return state_meta(self)

    def check_lora_meta(self, meta) -> None:
        from verl_hpc.engines.fsdp.lora import check_state_meta

        check_state_meta(self, meta)


def metric_sums(records: List[dict]) -> Tuple[torch.Tensor, List[str]]:
    """`[loss, tokens, token-weighted sums...]` summed over the ranks, on the device (not read),
    and the metrics' names. Every rank names the keys it has (a rank whose micro-batches are all
    empty has none); alone, its own keys are the keys (no pickled exchange, whose sizes a GPU
    would read to the host)."""
    keys = sorted({k for r in records for k in r} - {"loss", "tokens"})
    if dist.get_world_size() > 1:
        box: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(box, keys)
        keys = sorted({k for ks in box for k in ks})
    # summed where the records are (the device): the tokens are host numbers, added as
    # scalars; no copy to the device per record and metric
    dev = collective_device()
    vec = torch.zeros(2 + len(keys), dtype=torch.float64, device=dev)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    on_dev = (lambda v: zero + v if isinstance(v, (int, float))
              else torch.as_tensor(v).to(dev, torch.float64, non_blocking=True))
    for r in records:
        w = on_dev(r["tokens"])
        row = [on_dev(r["loss"]), w] + [on_dev(r[k]) * w if k in r else zero for k in keys]
        vec += torch.stack([x.reshape(()) for x in row])
    return sum_over_ranks(vec), keys


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
