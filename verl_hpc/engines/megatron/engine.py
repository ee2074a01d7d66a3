"""`MegatronEngine`: one Hugging Face model as Megatron-Core TP/PP/DP shards behind `TrainingEngine`.

    mp = verl_hpc.parallel.init_model_parallel(tp, pp)        # once per job, before any engine
    eng = MegatronEngine(options)                             # EngineOptions (options.py)
    out = eng.forward(batch)                                  # {"log_probs", "entropy"}: [B, T]
    metrics = eng.train_step(batch, loss_fn, outputs=("log_probs",))

Build (wiring.py sets up the parts in order, build.py builds the model, from the EngineOptions of
options.py): `verl_hpc.models.build_gpt_model` per (virtual) pipeline stage, weights from the HF
folder (each rank reads its own slices), a value head instead of the vocabulary projection for
critics and reward models (value_head.py), and the choices made once on the built model
(response-only output layers, prompt packing). Trainable
engines wrap every chunk in Megatron's DDP (fp32 grad buffers; gradient-reduce / parameter-gather
overlap per kernels.py, on with GPUs) and get Adam through get_megatron_optimizer (optim.py);
frozen ones (reference, reward) keep no grads and no optimizer and run in eval mode. With the
local layer spec (CPU), core attention runs through torch's SDPA kernel (sdpa.py;
`sdpa_attention=False` keeps Megatron's own).

Precision: the parameters are in `dtype` (bf16 on GPU, fp32 on CPU, where Megatron's CPU paths are
verified); fused kernels per kernels.py (on where they exist, off on CPU). No Float16Module
wrapper: it would upcast the whole `[b, s, V]` logits; outputs.py upcasts only the response rows
it needs. FP8 (`fp8=True`, model.fp8) selects the Transformer Engine
layer spec with Megatron's "hybrid" format and `fp8_recipe` (model.fp8_recipe); where there is no
GPU or no TE the engine refuses before building anything (verl_hpc.models.gpt.check_fp8_supported).
Sequences are padded to a multiple of the recipe's token alignment then (models.gpt.token_alignment:
32 for mxfp8, 16 for the others; TE's FP8 GEMMs need it).

A vision-language model (Qwen2.5-VL): the GPT model takes M-RoPE positions and its first stage holds
transformers' vision tower, which embeds the micro-batch's images before the first layer
(models/vlm.py); each micro-batch carries its rows' images and positions (vision.py).

Context parallelism (`parallel.cp`, context_parallel.py): the cp ranks of a DP replica take the
same micro-batches, each padded to a multiple of 2 * cp tokens; the model sees each rank's two
load-balanced chunks, per-token results are gathered over the CP group, CP rank 0 reports. It
needs Transformer Engine's attention: without it the engine refuses before building anything
(build.check_context_parallel). Gradients: Megatron's DDP sums over the dp x cp group.

Data flow per call: every rank gets the whole batch; partition.py plans which rows each DP rank
takes and how they form micro-batches; schedule.py runs them and reduces the results. Responses to
one prompt in a micro-batch may share one model row (prefix.py, `share_prompts`). An update plans
only the rows its loss does not name as adding nothing (LossFn.rows_without_gradient, e.g. the
policy loss's rows with all-zero advantages; engines/roles.py `rows_to_run`), with the counts of the whole batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from verl_hpc.engines.base import (EngineState, GlobalCounts, LossFn, TrainingEngine, scaler_metrics,
                                   skipped_for_overflow)
from verl_hpc.engines.batch import check_batch, get_response_mask, response_width
from verl_hpc.engines.megatron import context_parallel as cp_lib
from verl_hpc.engines.megatron import optim as optim_lib
from verl_hpc.engines.megatron import outputs as outputs_lib
from verl_hpc.engines.options import EngineOptions
from verl_hpc.engines.outputs import gather_outputs, metrics_from_sums, sum_over_ranks
from verl_hpc.engines.roles import rows_to_run
from verl_hpc.engines.prefix import rank_microbatches
from verl_hpc.engines.megatron.route_replay import KEY as ROUTES
from verl_hpc.engines.megatron.schedule import MicroBatch, run_schedule
from verl_hpc.engines.megatron.state import engine_state, load_engine_state
from verl_hpc.engines.megatron.wiring import wire
from verl_hpc.models import export_hf_weights
from verl_hpc.runtime.attention import trains_with_torch_attention
from verl_hpc.runtime.device import collective_device

log = logging.getLogger(__name__)


class MegatronEngine(TrainingEngine):
    def __init__(self, options: EngineOptions):
        # the checks, the layout, the model chunks (LoRA, DDP), the optimizer and the offloader (wiring.py)
        wire(self, options)

    def resident(self, what: str = "train"):
        """Context: the engine's offloaded states back on the device for `what` (forward | state |
        train, offload.RESIDENT); the outermost block offloads on exit."""
        return self.offloader.resident(what)

    # ------------------------------------------------------------------ parameters

    def _sync_params(self) -> None:
        """With overlap_param_gather the distributed optimizer's step leaves the all-gather of the
        updated parameters to the next forward's pre-hooks. Anything that reads parameters
        (forward-only scoring, weight export, checkpoints) gathers them here first."""
        if self._params_stale:
            for c in self.chunks:
                c.start_param_sync(force_sync=True)
            self._params_stale = False

    def _coll_device(self):
        return collective_device()

    def _parameters(self):
        for gpt in self.gpt_chunks:
            yield from gpt.parameters()

    def parameters(self):
        """This rank's parameters, up to date: with overlap_param_gather a step leaves the other
        ranks' shards to the next forward's all-gather, so it is forced first (_sync_params)."""
        self._sync_params()
        return list(self._parameters())

    # ------------------------------------------------------------------ running

    def _labels_path(self, want, chunked: bool = False) -> bool:
        """Log-probs only: let Megatron's own cross-entropy run on the unpermuted logits."""
        return (self.options.head == "lm" and tuple(want) == ("log_probs",) and self.options.temperature == 1.0
                and not chunked)

    def _output_fn(self, want, chunked: bool = False):
        if self.cp > 1:  # this rank's tokens -> whole-sequence results (context_parallel.py)
            kind = ("labels" if self._labels_path(want) else "lm" if self.options.head == "lm" else "value")
            return functools.partial(cp_lib.outputs, kind=kind, temperature=self.options.temperature)
        selected = bool(self._output_layers)
        if chunked:  # the output layer gave hidden states
            return functools.partial(outputs_lib.lm_outputs_chunked, head=self._chunked, selected=selected)
        if self._labels_path(want):
            return functools.partial(outputs_lib.lm_outputs_from_token_losses, selected=selected)
        if self.options.head == "lm":
            return functools.partial(outputs_lib.lm_outputs, temperature=self.options.temperature,
                                     selected=selected)
        return outputs_lib.value_outputs

    def _my_microbatches(self, batch, rows: Optional[List[int]] = None, share: bool = True) -> List[MicroBatch]:
        """This DP rank's micro-batches of `rows` of the batch (default: all), planned over those
        rows only, so the ranks share the work that is left. No rows at all still gives every rank
        a micro-batch (an empty one, which adds exactly 0: partition.py), so every rank enters the
        same collectives. share=False: one model row per sample (a forward that records routes)."""
        rows = list(range(batch["input_ids"].shape[0])) if rows is None else rows
        # the budget is per rank: a context-parallel group's micro-batch holds cp times it
        mine = rank_microbatches(batch, rows, self.dp, self.dp_rank, micro_batch_size=self.options.micro_batch_size,
                                 max_tokens=self.options.max_tokens_per_microbatch * self.cp,
                                 share_prompts=share and self._share_prompts is not None,
                                 multiple_of=self.pp if self.vpp else 1)
        shape = None
        if self.vpp:  # the interleaved schedule cannot take variable shapes (megatron-core 0.16.1)
            lengths = batch["prompt_lengths"] + batch["response_lengths"]
            seq = max(max((int(lengths[i]) for i in mb), default=1) for mb in mine)
            shape = (max(max(len(mb) for mb in mine), 1), -(-seq // self.pad_seq_to) * self.pad_seq_to)
        sharing = self._share_prompts if share else None
        return [MicroBatch(batch, mb, self.device, self.pad_seq_to, shape, sharing, self._cp_group, self.vision)
                for mb in mine]

    @trains_with_torch_attention  # runtime/attention.py: torch's SDPA choice, whatever vLLM set
    def forward(self, batch, outputs=None) -> Dict[str, torch.Tensor]:
        check_batch(batch, need_response=False)
        want = tuple(outputs or self.default_outputs)
        # routing replay: the batch's routes are replayed; under "old" a batch without them has
        # this forward's routes recorded (one model row per sample) and returned for the update
        record = self.replay_mode == "old" and ROUTES not in batch
        mbs = self._my_microbatches(batch, share=not record)
        for c in self.chunks:
            c.eval()
        if self.route_replay is not None:
            self.route_replay.begin(batch, record=record)
        with torch.no_grad(), self.resident("forward"):
            self._sync_params()
            chunked = outputs_lib.chunks_pass(self._logits_chunk, mbs)
            with outputs_lib.scoring(self._chunked if chunked else None):
                collected, _ = run_schedule(self.chunks, mbs, self._output_fn(want, chunked), want,
                                            forward_only=True, with_labels=self._labels_path(want, chunked),
                                            output_layers=self._output_layers, rotary=self._rotary,
                                            replay=self.route_replay)
        out = gather_outputs(collected, batch["input_ids"].shape[0], response_width(batch), want,
                             self.device, self.reporting)
        if self.route_replay is not None and record:
            out[ROUTES] = self.route_replay.routes(batch, self._coll_device())
        return out

    def route_metrics(self) -> Dict[str, float]:
        """Router agreement of the replayed forwards since the last call (collective: every rank
        calls it); {} without routing replay."""
        return self.route_replay.metrics(self._coll_device()) if self.route_replay is not None else {}

    def global_counts(self, batch) -> GlobalCounts:
        mask = get_response_mask(batch)
        norm = self.options.loss_norm_len or float(mask.shape[1])
        return GlobalCounts(tokens=float(mask.sum()), seqs=float(mask.shape[0]), norm_len=norm)

    def forward_backward(self, batch, loss_fn: LossFn, outputs: Sequence[str] = ()) -> List[dict]:
        """Gradients of the whole batch's loss into the DDP buffers (no optimizer step); returns
        this rank's per-micro-batch records (last stage only)."""
        if self.optimizer is None:
            raise RuntimeError("this engine is frozen (reference / reward model): no training")
        check_batch(batch)
        rows, skipped = rows_to_run(batch, loss_fn)
        # the loss's normalisers count every row, the skipped ones too: that keeps the update equal
        counts = dataclasses.replace(self.global_counts(batch),
                                     run_tokens=float(get_response_mask(batch)[rows].sum()))
        mbs = self._my_microbatches(batch, rows)
        if self.route_replay is not None:
            self.route_replay.begin(batch, record=False)
        self._skipped = skipped
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        want = tuple(outputs) or self.default_outputs[:1]
        chunked = outputs_lib.chunks_pass(self._logits_chunk, mbs)
        with outputs_lib.scoring(self._chunked if chunked else None):
            _, records = run_schedule(self.chunks, mbs, self._output_fn(want, chunked), want, loss_fn=loss_fn,
                                      counts=counts, forward_only=False,
                                      with_labels=self._labels_path(want, chunked),
                                      output_layers=self._output_layers,
                                      rotary=self._rotary, replay=self.route_replay)
        self._num_microbatches = len(mbs)
        self._packed_microbatches = sum(mb.packed for mb in mbs)
        return records

    @trains_with_torch_attention  # runtime/attention.py: torch's SDPA choice, whatever vLLM set
    def train_step(self, batch, loss_fn: LossFn, outputs: Sequence[str] = ()) -> Dict[str, float]:
        with self.resident("train"):
            return self._train_step(batch, loss_fn, outputs)

    def _train_step(self, batch, loss_fn: LossFn, outputs: Sequence[str] = ()) -> Dict[str, float]:
        from megatron.core.distributed import finalize_model_grads

        if self.router_stats is not None:
            self.router_stats.reset()
        records = self.forward_backward(batch, loss_fn, outputs)
        # DP gradient SUM (reduce-scatter with the distributed optimizer), tied-embedding and
        # sequence-parallel norm grads; num_tokens=None: no rescaling (schedule.py docstring).
        finalize_model_grads(self.chunks, num_tokens=None)
        sums, keys = self._metric_sums(records)
        scale = optim_lib.loss_scale(self.optimizer)  # the scale this backward used (fp16)
        # the metric sums are read with the gradient norm: one host read before the step
        applied, grad_norm, found_inf, vals = optim_lib.guarded_step(self.optimizer, sums)
        metrics = metrics_from_sums(vals, keys)
        self.steps_applied += int(applied)
        self._stepped_since_schedule |= applied
        self._params_stale |= applied and self.perf.overlap_param_gather
        overflow = skipped_for_overflow(applied, found_inf, metrics["loss"], scale, self.options.optim)
        metrics.update(grad_norm=grad_norm, lr=optim_lib.current_lr(self.optimizer),
                       nonfinite=0.0 if applied or overflow else 1.0,
                       **scaler_metrics(overflow, optim_lib.loss_scale(self.optimizer)),
                       num_microbatches=float(self._num_microbatches),
                       packed_microbatches=float(self._packed_microbatches), **(self._skipped or {}))
        if self.router_stats is not None:
            metrics.update(self.router_stats.metrics(self._coll_device()))
        metrics.update(self.route_metrics())
        if overflow:
            log.info("fp16 loss scale %g overflowed: optimizer step skipped, scale now %g", scale,
                     metrics["loss_scale"])
        elif not applied:
            log.warning("non-finite loss %.4g or grad norm %.4g: optimizer step skipped",
                        metrics["loss"], grad_norm)
        return metrics

    def _reduce_metrics(self, records: List[dict]) -> Dict[str, float]:
        """Loss = sum of contributions; loss_fn metrics = token-weighted means over the batch."""
        sums, keys = self._metric_sums(records)
        return metrics_from_sums(sums.tolist(), keys)

    def _metric_sums(self, records: List[dict]) -> Tuple[torch.Tensor, List[str]]:
        """`[loss, tokens, token-weighted sums...]` summed over the ranks, on the device (not read),
        and the metrics' names."""
        keys = sorted({k for r in records for k in r} - {"loss", "tokens"}) if self.reporting else []
        # replica 0 names the metrics: the planners (partition.py) give DP rank 0 rows first, so it
        # has some whenever any rank has, also when the loss left rows out (_rows_to_run)
        if dist.get_world_size() > 1:  # alone, this rank's keys are the keys: no pickle round trip
            box = [keys]
            dist.broadcast_object_list(box, src=self._key_source)
            keys = box[0]
        dev = self._coll_device()
        vec = torch.zeros(2 + len(keys), dtype=torch.float64, device=dev)
        if self.reporting:
            # device-side adds in the same order as one host loop, but no float(tensor) per record
            # and metric: each of those waits for the device (a host sync per micro-batch x key)
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            for r in records:
                w = float(r["tokens"])
                vec = vec + torch.stack([r["loss"].to(dev, torch.float64, non_blocking=True), zero + w] + [
                    r[k].to(dev, torch.float64, non_blocking=True) * w if k in r else zero for k in keys])
        return sum_over_ranks(vec), keys

    def scheduler_step(self) -> float:
        """One trainer step of the LR schedule, if an optimizer step was applied since the last
        call (base.py: a skipped update does not advance it, as in Megatron-LM)."""
        if self.scheduler is None:
            return 0.0
        if self._stepped_since_schedule:
            self.scheduler.step(increment=1)
        self._stepped_since_schedule = False
        return optim_lib.current_lr(self.optimizer)

    @property
    def lr(self) -> float:
        return optim_lib.current_lr(self.optimizer) if self.optimizer is not None else 0.0

    # ------------------------------------------------------------------ weights and state

    @contextlib.contextmanager
    def exported_model(self):
        """The model chunks, resident and with their parameters gathered: what export_hf_weights
        reads, for a reader of this rank's own shards alone (the sliced weight sync)."""
        with self.resident("forward"):  # offloaded weights come back for the export, then leave
            self._sync_params()
            yield self.gpt_chunks

    def export_hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The weights as full HF tensors, some of them views of live parameters. With
        param_offload a consumer that holds tensors past the generator's end (the weight sync's
        last bucket) must hold `resident("forward")` itself until it is done with them: this
        block's offload runs when the generator is exhausted (resharding.sync.held_resident)."""
        with self.exported_model() as chunks:
            if self.options.head == "value":
                from verl_hpc.engines.megatron.value_head import export_value_model

                yield from export_value_model(chunks, self.heads)
            else:
                yield from export_hf_weights(chunks)

    # ------------------------------------------------------------------ LoRA

    def adapters_off(self):
        """Context: the base model (the reference policy under LoRA); nothing to switch without."""
        if self.lora is None:
            return contextlib.nullcontext()
        from verl_hpc.models.lora import adapters_off

        return adapters_off(self.gpt_chunks)

    @property
    def adapter_version(self) -> int:
        """Which adapter the actor holds: the optimizer steps applied to it (0: the fresh one).
        The rollout engine must generate with this version (resharding's adapter sync checks)."""
        return self.steps_applied

    def adapter_config(self) -> dict:
        """PEFT's adapter_config.json of this engine's adapter."""
        from verl_hpc.models.lora_names import peft_config

        if self.lora is None:
            raise RuntimeError("this engine has no LoRA adapters (lora.rank = 0)")
        spec = self.lora
        return peft_config(spec.rank, spec.alpha, spec.targets, use_rslora=spec.use_rslora, dropout=spec.dropout,
                           base_model=self.options.model_path, vision=self.vision is not None)

    def export_adapter(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The adapter factors as PEFT-named full tensors, on every rank (a collective, like
        export_hf_weights; export_hf_weights itself exports the merged weights)."""
        from verl_hpc.models.lora import export_adapter

        if self.lora is None:
            raise RuntimeError("this engine has no LoRA adapters (lora.rank = 0)")
        with self.resident("forward"):
            self._sync_params()
            yield from export_adapter(self.gpt_chunks)

    def state(self) -> EngineState:
        """With offload on, the state is copied to host tensors while the engine is briefly
        resident, so that the roles of a checkpoint are on the device one at a time; resident
        means parameters and optimizer states, not the gradient buffers (a checkpoint has none)."""
        if not self.offloader.any:
            self._sync_params()
            return engine_state(self)
        with self.resident("state"):
            self._sync_params()
            st = engine_state(self)
            tensors = [dataclasses.replace(t, local=t.local.detach().to("cpu", copy=True))
                       for t in st.tensors]
        return dataclasses.replace(st, tensors=tensors)

    def load_state(self, load_into: Callable[[Sequence[Any]], None], meta: Mapping[str, Any]) -> None:
        with self.resident("state"):  # parameters and optimizer states; no gradient buffers
            load_engine_state(self, load_into, meta)
