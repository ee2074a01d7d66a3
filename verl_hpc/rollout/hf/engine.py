"""`HFRollout`: transformers `generate` behind the rollout interface, for machines without vLLM.

Each rank is one replica (rollout.tp must be 1) and generates its shard in batches of left-padded
prompts, n samples per prompt (`num_return_sequences`, rows i*n+j). Logprobs follow the same
`logprobs_mode` as VLLMRollout, in the same processing order as vLLM's sampler: raw logits ->
min_tokens' EOS mask -> temperature -> top-k -> top-p -> sample. To own that order, every
processor is passed to `generate` explicitly (HF would otherwise put custom processors before its
own temperature/top-k/top-p) with a generation config of our own (a model's generation_config.json
may carry top_k, repetition_penalty, ... that vLLM does not apply to explicit sampling params).
A recorder placed at the mode's point in that list keeps one step of log-softmax and gathers the
sampled token's value when the next step shows which token it was.

The n samples of a prompt share its prefill: the prompt (but its last token) runs through the
model once, its KV cache is repeated n times, and `generate` continues from it for the n rows.
HF's own `num_return_sequences` repeats the prompt before the prefill, which computes the same
keys and values n times (at 16 prompts x 8 samples, ~17-token prompts and 8 new tokens, about a
third of the generation time: docs/speed.md). The tokens drawn are the same
either way: the prefill draws no random numbers. `share_prefill=False` keeps HF's own expansion.

Greedy responses and logprobs equal vLLM's (fp32, <= 1e-4). Sampled responses do not: HF draws a
batch from torch's global generator (seeded per batch from the spec seed, inside a saved-and-
restored RNG state), vLLM per request.

Finish: the first EOS (kept in the response) or the first token whose text completes a stop
string (after min_tokens, as vLLM checks) ends a sequence with "stop"; otherwise "length".
"""
from __future__ import annotations

import os
import time
from typing import Iterable, List, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.hf_model import is_vision_language, read_hf_config
from verl_hpc.data.processor import collate_inputs, token_types
from verl_hpc.models.hf_checkpoint import WeightFileError
from verl_hpc.models.moe import checkpoint_views
from verl_hpc.rollout.engine import RolloutEngine, placeholder_ids
from verl_hpc.rollout.engine_config import RolloutOptions, engine_kwargs
from verl_hpc.rollout.hf.routes import RouteRecorder
from verl_hpc.rollout.replicas import ReplicaLayout
from verl_hpc.rollout.result import ShardOutput
from verl_hpc.rollout.sampling import SamplingSpec, check_logprobs_mode, request_seed
from verl_hpc.rollout.speculative.config import refuse_on_hf
from verl_hpc.rollout.vllm.compat import preserved_rng
from verl_hpc.rollout.weights import CheckedWeights, checkpoint_weight_names, renamed_on_load
from verl_hpc.runtime import device as devices, faults


class _SampledLogprobs:
    """A logits processor that records log-softmax(scores) of the tokens that get sampled."""

    def __init__(self):
        self.steps: List[torch.Tensor] = []
        self._last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:  # the token drawn from the previous step's scores
            self.steps.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.LongTensor) -> torch.Tensor:
        if self._last is not None:
            self.steps.append(self._last.gather(1, sequences[:, -1:]).squeeze(1))
            self._last = None
        return torch.stack(self.steps, dim=1).cpu()


def column_major_linear_weights(model: torch.nn.Module) -> None:
    """Store each nn.Linear weight ([out, in]) column-major: the same values, its transpose
    contiguous in memory. `F.linear` multiplies by the transpose, so MKL then reads a contiguous
    right operand, which its single-thread GEMM does faster when the left one has few rows, as in
    decoding (one row per sequence): 34 against 29 GFLOP/s at 64 x 768 x 2560 in a one-off
    measurement on the 2-core CI machine; the generate stage of `benchmarks/bench_vs_trl.py --sizes
    100m` (8 prompts x 8 samples x 24 tokens, 1 thread) went from 10.4-10.5 s to 9.9-10.1 s.
    Products with many rows (prefill) run alike either way. Loading weights
    copies into these tensors in their own memory order, keeping the layout; a tied embedding
    reads rows with a stride."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


class HFRollout(RolloutEngine):
    name = "hf"

    # dtype, the lengths and prompt_overflow are config fields: required, so that from_options binds
    # the sections; code without a config uses engine_config.default_engine_args
    def __init__(self, model_path: str, *, dtype: str, max_prompt_length: int, max_response_length: int,
                 prompt_overflow: str, tp: int = 1, seed: int = 0, batch_size: int = 64,
                 tokenizer_path: str | None = None, trust_remote_code: bool = False,
                 logprobs_mode: str = "processed", share_prefill: bool = True, record_routes: bool = False,
                 speculative=None, ctx=None, **_ignored):
        from transformers import GenerationConfig

        refuse_on_hf(speculative)  # rollout.speculative: vLLM only (rollout/speculative/config.py says why)
        if tp != 1:  # the config refuses engine=hf with tp > 1; auto or fastest may still pick hf here
            raise ConfigError(f"rollout.tp={tp} needs rollout.engine=vllm: the HF fallback runs one "
                              "replica per rank (rollout.tp=1)")
        layout = ReplicaLayout.detect(1, ctx)
        super().__init__(layout=layout, max_prompt_length=max_prompt_length,
                         max_response_length=max_response_length,
                         prompt_overflow=prompt_overflow, vocab_size=None)
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        self.device = ctx.device if ctx is not None else (
            devices.device_for(int(os.environ.get("LOCAL_RANK", 0))) if devices.has_gpu()
            else torch.device("cpu"))
        self.batch_size = int(batch_size)
        self.share_prefill = bool(share_prefill)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self._tokenizer = None
        self.trust_remote_code = trust_remote_code
        torch_dtype = getattr(torch, dtype) if self.device.type != "cpu" else torch.float32
        # the headers first: a truncated or damaged file is named (WeightFileError) here, not deep
        # inside transformers' loader as a bare SafetensorError
        self._required = checkpoint_weight_names(model_path)
        folder_config = read_hf_config(model_path)
        self.vision = is_vision_language(folder_config)
        self.placeholder_ids = placeholder_ids(folder_config) if self.vision else ()
        with preserved_rng(self.device):
            self.model = _auto_class(self.vision).from_pretrained(
                model_path, dtype=torch_dtype, trust_remote_code=trust_remote_code).to(self.device)
        self.model.eval()
        if self.device.type == "cpu":
            column_major_linear_weights(self.model)
        config = self.model.config.get_text_config()  # a VLM's token ids live in its text config
        self.vocab_size = config.vocab_size
        eos = self.model.generation_config.eos_token_id
        eos = config.eos_token_id if eos is None else eos
        self.eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or ()))
        pad = config.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        # vLLM applies none of a model's generation_config.json defaults (top_k, repetition
        # penalty, ...) to explicit sampling params; HF fills unset fields from it: start clean.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id,
            bos_token_id=config.bos_token_id)
        # an MoE model's experts live fused in memory; their checkpoint names get views (models/moe.py)
        self._targets = {**self.model.state_dict(keep_vars=True),
                         **dict(self.model.named_parameters(remove_duplicate=False)),
                         **checkpoint_views(self.model)}
        if self.vision:  # released VLM folders keep older tensor names that transformers renames on load
            self._required = set(self.model.state_dict())
            self.image_token_id = self.model.config.image_token_id
        # a checkpoint name transformers renames on load (GPT-NeoX's embed_out.weight -> lm_head.weight):
        # the model's name is the one required (the engines send it), the checkpoint's is accepted too
        renamed = renamed_on_load(self.model, self._required - set(self._targets))
        self._targets.update({old: self._targets[new] for old, new in renamed.items() if new in self._targets})
        self._required = {renamed.get(n, n) for n in self._required}
        unknown = sorted(self._required - set(self._targets))
        if unknown:
            raise WeightFileError(f"hf rollout: checkpoint tensors {unknown[:3]} are not named like the "
                                  f"model's parameters ({model_path})")
        # e.g. a tied lm_head.weight; an MoE model's fused expert tensors (their views are required)
        self._optional = set(self._targets) - self._required
        # routing replay (model.moe_routing_replay = rollout): every row's experts per token and layer
        self.routes = RouteRecorder(self.model) if record_routes else None

    @classmethod
    def from_options(cls, options: RolloutOptions, ctx=None, **overrides) -> "HFRollout":
        return cls(options.model.path, ctx=ctx, **{**engine_kwargs(options, "hf"), **overrides})

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.tokenizer_path, trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    # ------------------------------------------------------------------ generate
    def _generate_shard(self, prompts: List[List[int]], first_index: int,
                        sampling: SamplingSpec, media=None) -> ShardOutput:
        if media is not None and not self.vision:
            raise ValueError("hf rollout: prompts with images, but the model is text-only")
        rows = ShardOutput.empty()
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start:start + self.batch_size]
            images = media[start:start + self.batch_size] if media is not None else None
            rows.extend(self._generate_batch(batch, first_index + start, sampling, images))
        return rows

    def _processors(self, s: SamplingSpec, prompt_len: int, recorder: _SampledLogprobs):
        from transformers.generation import logits_process as lp

        chain = [recorder] if self.logprobs_mode == "raw" else []
        if s.min_tokens and self.eos_ids:
            chain.append(lp.MinNewTokensLengthLogitsProcessor(
                prompt_len, s.min_tokens, self.eos_ids, device=self.device))
        if not s.greedy:
            if s.temperature != 1.0:
                chain.append(lp.TemperatureLogitsWarper(s.temperature))
            if s.top_k > 0:
                chain.append(lp.TopKLogitsWarper(top_k=s.top_k))
            if s.top_p < 1.0:
                chain.append(lp.TopPLogitsWarper(top_p=s.top_p))
        if self.logprobs_mode == "processed":
            chain.append(recorder)
        return lp.LogitsProcessorList(chain)

    @torch.no_grad()
    def _generate_batch(self, prompts: List[List[int]], first_index: int,
                        s: SamplingSpec, media=None) -> ShardOutput:
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        recorder = _SampledLogprobs()
        copies = 1 if s.greedy else s.n  # HF refuses n > 1 greedy: generate once, repeat below
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache, expand, images = None, copies, {}
        if self.vision:  # pixel values of the batch's images in row order; M-RoPE's token types
            images = {k: v.to(self.device) for k, v in
                      collate_inputs([m.inputs if m is not None else None for m in media or []]).items()}
            if images:
                images["mm_token_type_ids"] = token_types(ids, self.image_token_id)
        if self.routes is not None:
            self.routes.start()
        if self.share_prefill and copies > 1 and width > 1 and not images:
            cache = self._shared_prefill(ids, mask, copies)
            ids, mask, expand = ids.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0), 1
        gen = GenerationConfig(
            max_new_tokens=s.max_tokens, do_sample=not s.greedy, num_return_sequences=expand,
            eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id,
            # our processors do temperature/top-k/top-p (module doc); HF's stay neutral
            **({} if s.greedy else dict(temperature=1.0, top_k=0, top_p=1.0)))
        # HF's own stop-string check only saves work (the cut is ours, in _finish); it ignores
        # min_tokens, so it is left out when min_tokens is set
        extra = (dict(stop_strings=list(s.stop), tokenizer=self.tokenizer)
                 if s.stop and not s.min_tokens else {})
        with preserved_rng(self.device):
            torch.manual_seed(request_seed(s.seed, "hf", first_index))
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, past_key_values=cache,
                generation_config=gen, logits_processor=self._processors(s, width, recorder),
                **extra, **images)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        logprobs = recorder.finish(sequences).tolist()
        responses = sequences[:, width:].cpu().tolist()
        routes = None
        if self.routes is not None:  # [generated rows, fed positions, L, k]; left-padded columns
            self.routes.stop()
            routes = self.routes.joined(sequences.shape[0], sequences.shape[1] - 1)
        rows = ShardOutput.empty()
        for r in range(len(prompts) * s.n):
            tokens, lps = responses[r // (s.n // copies)], logprobs[r // (s.n // copies)]
            end, reason = self._finish(tokens, s)
            if routes is not None:  # the prompt's and the response's tokens but the last (never fed)
                plen = len(prompts[r // s.n])
                rows.routes.append(routes[r // (s.n // copies), width - plen:width + end - 1].clone())
            rows.prompt_index.append(first_index + r // s.n)
            rows.sample_index.append(r % s.n)
            rows.response_ids.append(tokens[:end])
            rows.logprobs.append(lps[:end])
            rows.finish_reason.append(reason)
        return rows

    @torch.no_grad()
    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, copies: int):
        """KV cache of every prompt but its last token, computed once and repeated `copies` times
        (row i*copies+j = prompt i). `generate` then feeds only the last prompt token of each row.
        Positions as `generate` derives them for left padding (attention-mask cumsum)."""
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                         position_ids=positions[:, :-1], use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(copies)
        return cache

    def _finish(self, tokens: List[int], s: SamplingSpec) -> Tuple[int, str]:
        """Length of the response and why it ended (rows past the end are HF's padding)."""
        end, reason = len(tokens), "length"
        for pos, tok in enumerate(tokens):
            if tok in self.eos_ids and pos >= s.min_tokens:
                end, reason = pos + 1, "stop"
                break
        if s.stop:
            decode = lambda k: self.tokenizer.decode(tokens[:k], skip_special_tokens=True)  # noqa: E731
            if any(stop in decode(end) for stop in s.stop):
                floor = len(decode(s.min_tokens))  # vLLM looks for stops after min_tokens only
                for count in range(s.min_tokens + 1, end + 1):
                    text = decode(count)
                    if any(0 <= text.find(stop, max(floor - len(stop) + 1, 0)) for stop in s.stop):
                        return count, "stop"
        return end, reason

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> dict:
        """Copy each tensor into the parameter of that HF name (strict: unknown names, repeated
        names, wrong shapes and missing checkpoint tensors are errors)."""
        faults.maybe("load")  # the resilience tests' hook (runtime/faults.py)
        if self._closed:
            raise RuntimeError("hf rollout: load_weights() after close()")
        checked = CheckedWeights(weights, self._required, self._optional, pass_optional=True)
        start = time.perf_counter()
        try:
            for name, tensor in checked:
                param = self._targets[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, the "
                                     f"model's is {tuple(param.shape)}")
                source = tensor.to(device=param.device, dtype=param.dtype)
                if param.dim() == 2 and not param.is_contiguous() and param.t().is_contiguous():
                    # a column-major weight: copying in its memory order is ~4x faster on CPU
                    # than torch's copy_ into the strided view (14 vs 3.4 ms at 2560 x 768)
                    param.t().copy_(source.t())
                else:
                    param.copy_(source)
            checked.finish()
        except Exception as exc:
            self._mark_broken(f"{type(exc).__name__}: {str(exc)[:200]}")
            raise
        self._broken = None  # a complete update defines every weight again
        return dict(tensors=checked.tensors, bytes=checked.bytes,
                    seconds=time.perf_counter() - start)

    def _recovery_hint(self) -> str:
        return "call load_weights again with every weight"

    def rebuild(self, *, smaller: bool) -> str:
        """After a failed generate (rollout/recovery.py): the model object stays (generate does not
        change its weights; the trainer's sync that follows rewrites them all), its cached device
        memory goes back, and after an out-of-memory the generation batches are halved."""
        devices.release_cached_memory()
        if not (smaller and self.batch_size > 1):
            return ""
        before, self.batch_size = self.batch_size, self.batch_size // 2
        return f"HF generate batch_size {before} -> {self.batch_size}"

    def _sleep_unsupported_reason(self) -> str:
        return "the HF fallback keeps its weights where they are"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.model = None
            self._targets = {}


def _auto_class(vision: bool):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision else AutoModelForCausalLM
