"""Tiny Hugging Face models for tests and the demo: a real HF folder, made from nothing, offline.

    python -m verl_hpc.models.tiny OUT --family llama|qwen2|mistral|mixtral|qwen2_moe|qwen3_moe
                                               |deepseek_v3|gemma3|phi3|olmo2
                                   [--tied] [--layers 2] [--shards 2]

writes OUT/config.json, model.safetensors (or model-0000k-of-0000n.safetensors + index.json),
tokenizer.json and tokenizer_config.json. `transformers.AutoModelForCausalLM.from_pretrained`,
`AutoTokenizer` and vLLM load it. Shapes default to hidden 128, 4 heads, 2 KV heads (GQA), head_dim
32 (vLLM's CPU attention needs >= 32), vocab 500: deliberately not a multiple of 128, so Megatron's
vocabulary padding is exercised at every TP size. The mixture-of-experts families have 4 experts of
FFN 64, 2 per token (Qwen2-MoE also a gated shared expert of FFN 96). DeepSeek-V3: multi-head
latent attention (q_lora_rank 64, or None with q_lora_rank=None; kv_lora_rank 32, nope/rope/v head
dims 32), layer 0 dense (FFN 256), then MoE layers of 4 experts of FFN 64 in 2 groups (1 group
chosen, 2 experts per token, weights x 2.5), one shared expert and a random per-expert bias. Gemma 3 (text), Phi-3 and
OLMo 2 are families the Megatron mapping does not cover (the FSDP engine trains them as transformers
builds them), from transformers' own config classes: Gemma 3 alternates a sliding-window layer
(window 16, so the test sequences slide) and a full-attention one, Phi-3 fuses qkv_proj and
gate_up_proj, OLMo 2 normalises q and k over all heads and after each block. Output is a pure
function of the arguments. A bad argument (a count below 1, a vocabulary smaller than the
tokenizer, an OUT that cannot be created) is one `error: ...` line and exit code 2.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from pathlib import Path
from typing import Dict, List

import torch

from verl_hpc.config.errors import ConfigError

MEGATRON_MAPPED = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# families only the FSDP engine trains: transformers' own config class and model, no mapping
HF_ONLY = ("gemma3", "phi3", "olmo2")
FAMILIES = MEGATRON_MAPPED + HF_ONLY
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
# ChatML-like: role headers between <|im_start|> / <|im_end|>, as most instruct models do.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_WORDS = ("the answer is what plus minus times equals compute sum of and a number question think "
          "step first then so result user assistant system please give final").split()


def corpus(seed: int = 0, lines: int = 2000) -> List[str]:
    """A small built-in training text: arithmetic, digits and a few words."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, res = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
        out.append(f"{words} {a} {op} {b} = {res}")
        out.append(f"What is {a} {op} {b}? The answer is {res}.")
    return out


@functools.lru_cache(maxsize=4)
def _trained_bpe(vocab_size: int, seed: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok.to_str()


def train_tokenizer(vocab_size: int = 480, seed: int = 0):
    """A byte-level BPE tokenizer trained on `corpus(seed)`, wrapped for transformers."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe(vocab_size, seed)),
        bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHAT_TEMPLATE,
        model_max_length=256)


def hf_config(family: str, *, tied: bool = False, layers: int = 2, vocab_size: int = 500,
              hidden: int = 128, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
              ffn: int = 256, max_positions: int = 256, special_ids: Dict[str, int] | None = None,
              rope_scaling: Dict | None = None, experts: int = 4, top_k: int = 2, expert_ffn: int = 64,
              shared_ffn: int = 96, norm_topk_prob: bool | None = None, q_lora_rank: int | None = 64):
    """A transformers config object of the family with tiny shapes. `rope_scaling` (e.g.
    {"rope_type": "llama3", "factor": 8.0, ...}) is merged into rope_parameters."""
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

    if family not in FAMILIES:
        raise ConfigError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
    ids = special_ids or {}
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, bos_token_id=ids.get("bos"),
                  eos_token_id=ids.get("eos"), pad_token_id=ids.get("pad"))
    if family in HF_ONLY:
        return _hf_only_config(family, common, head_dim=head_dim, rope_scaling=rope_scaling)
    if family == "deepseek_v3":
        return _deepseek_config(common, experts=experts, top_k=top_k, expert_ffn=expert_ffn,
                                q_lora_rank=q_lora_rank, rope_scaling=rope_scaling)
    theta = {"llama": 10000.0, "mistral": 100000.0, "qwen2": 1000000.0, "mixtral": 1000000.0,
             "qwen2_moe": 1000000.0, "qwen3_moe": 1000000.0}[family]
    rope = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    if family == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": expert_ffn}, head_dim=head_dim,
                             sliding_window=None, num_local_experts=experts, num_experts_per_tok=top_k,
                             architectures=["MixtralForCausalLM"], rope_parameters=rope)
    if family in ("qwen2_moe", "qwen3_moe"):
        moe = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
                   decoder_sparse_step=1, mlp_only_layers=[],
                   norm_topk_prob=(family == "qwen3_moe") if norm_topk_prob is None else norm_topk_prob)
        if family == "qwen3_moe":  # released Qwen3-MoE checkpoints renormalise the top-k
            return Qwen3MoeConfig(**common, **moe, head_dim=head_dim, architectures=["Qwen3MoeForCausalLM"],
                                  rope_parameters=rope)
        if hidden != heads * head_dim:
            raise ConfigError("qwen2_moe: head_dim is hidden_size / num_attention_heads in this family")
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=shared_ffn,
                              architectures=["Qwen2MoeForCausalLM"], rope_parameters=rope)
    if family == "llama":
        return LlamaConfig(**common, head_dim=head_dim, architectures=["LlamaForCausalLM"],
                           rope_parameters=rope)
    if family == "mistral":
        return MistralConfig(**common, head_dim=head_dim, sliding_window=None,
                             architectures=["MistralForCausalLM"], rope_parameters=rope)
    if hidden != heads * head_dim:
        raise ConfigError("qwen2: head_dim is hidden_size / num_attention_heads in this family")
    return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"], rope_parameters=rope)


def _deepseek_config(common: Dict, *, experts: int, top_k: int, expert_ffn: int, q_lora_rank: int | None,
                     rope_scaling: Dict | None):
    """A tiny DeepSeek-V3: every feature the Megatron mapping builds is on (models/deepseek.py)."""
    from transformers import DeepseekV3Config

    groups = 2 if experts % 2 == 0 and experts >= 4 else 1
    return DeepseekV3Config(**{**common, "num_key_value_heads": common["num_attention_heads"]},
                            n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
                            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                            n_group=groups, topk_group=max(1, top_k // 2) if groups > 1 else 1,
                            norm_topk_prob=True, q_lora_rank=q_lora_rank, kv_lora_rank=32,
                            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, rope_interleave=True,
                            num_nextn_predict_layers=0, architectures=["DeepseekV3ForCausalLM"],
                            # as the released config.json says (transformers' class has no such fields;
                            # vLLM builds the router's bias only when topk_method is noaux_tc)
                            topk_method="noaux_tc", scoring_func="sigmoid",
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})})


def _hf_only_config(family: str, common: Dict, *, head_dim: int, rope_scaling: Dict | None):
    """The config of a family the Megatron mapping does not cover, from transformers' own class."""
    from transformers import Gemma3TextConfig, Olmo2Config, Phi3Config

    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    if family == "gemma3":  # one sliding layer, one global, each with its own RoPE base (as released)
        layers = common["num_hidden_layers"]
        kinds = [("full_attention" if (i + 1) % 2 == 0 else "sliding_attention") for i in range(layers)]
        return Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                sliding_window=16, layer_types=kinds,
                                rope_parameters={"sliding_attention": rope,
                                                 "full_attention": {**rope, "rope_theta": 1000000.0}},
                                architectures=["Gemma3ForCausalLM"])
    if common["hidden_size"] != common["num_attention_heads"] * head_dim:
        raise ConfigError(f"{family}: head_dim is hidden_size / num_attention_heads in this family")
    if family == "phi3":
        return Phi3Config(**common, original_max_position_embeddings=common["max_position_embeddings"],
                          rope_parameters=rope, architectures=["Phi3ForCausalLM"])
    return Olmo2Config(**common, rope_parameters=rope, architectures=["Olmo2ForCausalLM"])


def random_state_dict(model: torch.nn.Module, seed: int, *, norm_offset: bool = False) -> Dict[str, torch.Tensor]:
    """Seeded weights: matrices and biases N(0, 0.02); norm weights 1 + N(0, 0.1), so that a
    swapped or misplaced norm in a weight mapping changes the logits visibly; routers N(0, 1), so
    that the experts a token picks are clear-cut (not near-ties that rounding could flip).
    `norm_offset`: the model scales by 1 + weight (Gemma), so its norm weights are N(0, 0.1).
    A norm is a tensor named so, or one of a module whose class is a norm (Qwen2.5-VL's patch merger
    calls its RMSNorm `ln_q`: drawn as a matrix, it shrank the merged patches 50-fold under the
    merger's biases, and every picture gave nearly the same image tokens)."""
    gen = torch.Generator().manual_seed(seed)
    biased = any(n.endswith("e_score_correction_bias") for n in model.state_dict())  # DeepSeek-V3's router
    norms = {f"{m}.{n}" if m else n for m, module in model.named_modules() if type(module).__name__.endswith("Norm")
             for n, _ in module.named_parameters(recurse=False)}
    out = {}
    for name, p in sorted(model.state_dict().items()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        router = name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
        norm = (0.0 if norm_offset else 1.0) + 0.1 * noise
        out[name] = norm if "norm" in name or name in norms else noise if router else 0.02 * noise
        if biased:  # a sigmoid router saturates at N(0, 1) (exact ties at 1.0 in fp32): logits ~N(0, 1)
            if router:
                out[name] = noise / p.shape[-1] ** 0.5
            elif name.endswith("e_score_correction_bias"):  # large enough to change some choices
                out[name] = 0.1 * noise
    return out


def checkpoint_format(state: Dict[str, torch.Tensor], family: str) -> Dict[str, torch.Tensor]:
    """transformers 5 keeps a mixture-of-experts layer's experts fused in memory (`gate_up_proj`
    [E, 2F, H], `down_proj` [E, H, F]) and converts on load; released checkpoints (and vLLM, and
    this project's loader) have one tensor per expert and matrix. This is that on-disk form:
    experts.{e}.gate_proj/up_proj/down_proj (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2 and
    block_sparse_moe.gate)."""
    if family not in MOE_FAMILIES:
        return state
    names = ({"gate": "w1", "up": "w3", "down": "w2"} if family == "mixtral"
             else {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    out = {}
    for key, t in state.items():
        prefix, _, leaf = key.rpartition("mlp.experts.")
        if leaf in ("gate_up_proj", "down_proj") and prefix:
            block = prefix + ("block_sparse_moe.experts." if family == "mixtral" else "mlp.experts.")
            block = block.replace("mlp.block_sparse_moe", "block_sparse_moe")
            for e in range(t.shape[0]):
                if leaf == "down_proj":
                    out[f"{block}{e}.{names['down']}.weight"] = t[e].clone()
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{block}{e}.{names['gate']}.weight"] = gate.clone()
                    out[f"{block}{e}.{names['up']}.weight"] = up.clone()
        elif family == "mixtral" and key.endswith("mlp.gate.weight"):
            out[key.replace("mlp.gate.weight", "block_sparse_moe.gate.weight")] = t
        else:
            out[key] = t
    return out


def save_safetensors(state: Dict[str, torch.Tensor], out: Path, shards: int = 1) -> List[Path]:
    """HF layout: one model.safetensors, or `shards` files plus model.safetensors.index.json."""
    from safetensors.torch import save_file

    names = sorted(state)
    if shards <= 1:
        save_file({n: state[n].contiguous() for n in names}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        return [out / "model.safetensors"]
    groups = [names[i::shards] for i in range(shards)]  # interleaved: every file holds layers
    files, weight_map = [], {}
    for k, group in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n].contiguous() for n in group}, str(out / fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        files.append(out / fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def make_tiny_model(out, family: str = "llama", *, tied: bool = False, layers: int = 2,
                    vocab_size: int = 500, seed: int = 0, shards: int = 1, **shape) -> Path:
    """Write a tiny HF model folder to `out` and return its path. Deterministic given the args.

    `seed` draws the weights; every tiny model shares one tokenizer (trained on corpus(0)).
    `shape` overrides hf_config's sizes (hidden, heads, kv_heads, head_dim, ffn, max_positions,
    rope_scaling)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size=min(480, vocab_size))
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"vocab_size={vocab_size} (--vocab-size) is smaller than the tokenizer's "
                          f"{len(tokenizer)} tokens; valid: >= {len(tokenizer)}")
    ids = {k: tokenizer.convert_tokens_to_ids(f"<|{k}|>") for k in ("bos", "eos", "pad")}
    config = hf_config(family, tied=tied, layers=layers, vocab_size=vocab_size,
                       special_ids=ids, **shape)
    torch.manual_seed(seed)  # from_config initialises weights; they are all replaced below
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = checkpoint_format(random_state_dict(model, seed, norm_offset=family == "gemma3"), family)
    if tied:
        state.pop("lm_head.weight", None)  # HF checkpoints of tied models store it once
    config.save_pretrained(out)
    save_safetensors(state, out, shards=shards)
    tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_hpc.models.tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output folder (created)")
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--tied", action="store_true", help="tie input embeddings and lm_head")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=500)
    ap.add_argument("--shards", type=int, default=1, help="safetensors files (>1 writes an index)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    return write_cli(a.out, {"layers": a.layers, "shards": a.shards},
                     lambda: make_tiny_model(a.out, a.family, tied=a.tied, layers=a.layers,
                                             vocab_size=a.vocab_size, seed=a.seed, shards=a.shards))


def write_cli(out, counts: Dict[str, int], make) -> int:
    """The tail of a tiny-model command: `counts` ({option: value}) must be >= 1, then `make()`
    writes the folder; the path printed, or one `error: ...` line and the error's exit code."""
    try:
        small = [f"--{k}: got {v}" for k, v in counts.items() if v < 1]
        if small:
            raise ConfigError(f"{'; '.join(small)}; valid: a count >= 1")
        try:
            path = make()
        except OSError as e:  # OUT under a file, no permission, a full disk
            raise ConfigError(f"OUT '{out}': cannot write the model there: {e.strerror or e}") from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
