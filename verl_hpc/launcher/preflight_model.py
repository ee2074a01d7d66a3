"""Before the queue: a model folder's weights against its config.json, its tokenizer, and the
LoRA adapter lora.init_from names.

The job builds the model from config.json and then copies each safetensors tensor into it; a
config.json that disagrees with the weights (another hidden size, vocabulary or layer count)
fails there, after the queue, with a raw shape error. Here the safetensors headers (read without
the weights) are compared with the names and shapes the project's weight rules
(verl_hpc/models/weight_rules.py) derive from config.json, and the tokenizer the job will load
(model.tokenizer_path, model.path by default) is loaded and its ids compared with vocab_size.
An adapter folder (lora.init_from) is checked whole against the job's lora section and the base:
its config, tensor names, shapes and dtypes, and its values (models/peft_adapter.py), so that an
adapter the engine would compute otherwise than PEFT fails here, not after vLLM is built.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from verl_hpc.config import ConfigError
from verl_hpc.models.safetensors_header import HeaderEntry, read_header, tensors_of  # noqa: F401 (callers take them here too)

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # the loader casts between these; an integer tensor is wrong
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# files a Hugging Face tokenizer is read from (any one of the first three, usually with the config)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


# ------------------------------------------------------------------------------ weights vs config.json
def weights_problems(folder: Path, field: str, found: Dict[str, HeaderEntry], value_head: bool) -> List[str]:
    """One line per kind of disagreement between config.json and the weights (layer count, then
    shapes, then missing tensors, then dtypes), each naming a tensor, its file and both shapes."""
    from verl_hpc.models.config_mapping import load_arch, load_hf_config
    from verl_hpc.models.weight_rules import expected_hf_tensors

    try:
        arch = load_arch(folder)
    except ConfigError:
        return []  # model_folder_problems already reports the config.json itself
    # the field this file counts its experts in (Mixtral's name, or Qwen's; transformers 5 writes both spellings)
    data = load_hf_config(folder)
    experts_key = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in data),
                       "num_experts")
    expected = expected_hf_tensors(arch, output_layer=not value_head)
    source = f"'{folder / 'config.json'}'"
    # DeepSeek-V3's multi-token-prediction layers follow the decoder's (model.layers.{L}...): stored
    # or not (save_pretrained and this project's HF export write none), never loaded (models/deepseek.py
    # ignores them, as transformers does)
    mtp = int(data.get("num_nextn_predict_layers") or 0) if arch.mla is not None else 0
    problems = _layer_count(field, source, arch.num_layers, found, mtp)
    if problems:
        return problems  # every tensor of the missing or extra layers would repeat it
    wrong = [(n, s) for n, s in expected.items() if n in found and found[n][0] != s]
    if wrong:
        name, shape = wrong[0]
        problems.append(f"{field}: tensor '{name}' in '{folder / found[name][2]}' has shape {list(found[name][0])}; "
                        f"{source} ({_facts(arch, name, experts_key)}) implies {list(shape)}{_more(wrong, 'tensors disagree')}; "
                        "valid: the config.json these weights were saved with")
    missing = [n for n in expected if n not in found]
    if missing:
        problems.append(f"{field}: '{folder}' has no tensor '{missing[0]}', which {source} implies"
                        f"{_more(missing, 'missing')}; valid: weights saved with this config.json "
                        "(e.g. tie_word_embeddings decides whether lm_head.weight is stored)")
    ints = [n for n in expected if n in found and found[n][1] not in FLOAT_DTYPES]
    if ints:
        n = ints[0]
        problems.append(f"{field}: tensor '{n}' in '{folder / found[n][2]}' has dtype {found[n][1]}; "
                        f"valid: {', '.join(FLOAT_DTYPES)}{_more(ints, 'with a wrong dtype')}")
    return problems


def _layer_count(field: str, source: str, layers: int, found: Dict[str, HeaderEntry], mtp: int = 0) -> List[str]:
    """The stored layers are the decoder's, optionally followed by the `mtp` multi-token-prediction ones."""
    held = sorted({int(m.group(1)) for n in found if (m := _LAYER.match(n))})
    if held in (list(range(layers)), list(range(layers + mtp))):
        return []
    have = f"layers {held[0]}..{held[-1]} ({len(held)} layers)" if held else "no layers"
    first = next((n for n in sorted(found) if _LAYER.match(n) and int(_LAYER.match(n).group(1)) >= layers + mtp),
                 None)
    where = f" (e.g. '{first}' in '{found[first][2]}')" if first else ""
    said = f"num_hidden_layers = {layers}" + (f" and num_nextn_predict_layers = {mtp} (stored or not)" if mtp else "")
    return [f"{field}: {source} has {said}, the weights hold {have}{where}; "
            "valid: the config.json these weights were saved with"]


def _facts(arch, name: str, experts_key: str = "num_experts") -> str:
    """The config.json fields a tensor's shape comes from (an MoE layer's by their MoE names: the
    router's rows are the expert count, an expert's the expert FFN)."""
    moe = arch.moe
    expert_ffn_key = "intermediate_size" if arch.family == "mixtral" else "moe_intermediate_size"
    if "embed_tokens" in name or "lm_head" in name:
        keys = ("vocab_size", "hidden_size")
    elif moe and name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
        keys = (experts_key, "hidden_size")
    elif moe and ".experts." in name:
        keys = (expert_ffn_key, "hidden_size")
    elif moe and ".shared_expert." in name:
        keys = ("shared_expert_intermediate_size", "hidden_size")
    elif ".mlp." in name and not moe:
        keys = ("intermediate_size", "hidden_size")
    elif name.endswith(("q_norm.weight", "k_norm.weight")):
        keys = ("head_dim",)
    elif ".self_attn." in name:
        keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    else:
        keys = ("hidden_size",)
    values = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
                  num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_query_groups,
                  head_dim=arch.head_dim)
    if moe:
        values.update({experts_key: moe.num_experts, expert_ffn_key: moe.expert_ffn,
                       "shared_expert_intermediate_size": moe.shared_ffn})
    return ", ".join(f"{k}={values[k]}" for k in keys)


def _more(items: list, what: str) -> str:
    return f" (and {len(items) - 1} more {what})" if len(items) > 1 else ""


# ------------------------------------------------------------------------------ tokenizer
def load_tokenizer(cfg) -> Tuple[object, List[str]]:
    """(the tokenizer the job will load, []) or (None, [one line saying why it cannot])."""
    folder = Path(cfg.model.tokenizer_path)
    field = "model.tokenizer_path" if cfg.model.tokenizer_path != cfg.model.path else "model.path"
    if not folder.is_dir():
        return None, []  # validate() already names a missing folder
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None, [f"{field}: '{folder}' has no tokenizer files; the job loads its tokenizer from there "
                      f"(model.tokenizer_path, default model.path); valid: a folder with {', '.join(TOKENIZER_FILES)}"]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad tokenizer folder
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, [f"{field}: '{folder}': the tokenizer does not load ({type(e).__name__}: {reason}); "
                      f"valid: a Hugging Face tokenizer folder ({', '.join(TOKENIZER_FILES)})"]
    return tok, []


def prm_problems(cfg, tokenizer) -> List[str]:
    """PRIME's PRM (prm.model_path) scores the actor's token ids: the rollout's responses are
    tokenized once, with the actor's tokenizer, and the PRM's log-probs of those ids are compared
    with the reference's. A PRM trained with another tokenizer reads each id as another token, and
    one whose vocab_size is below the ids indexes past its embedding. One tokenizer per job is the
    design, so a PRM folder that holds a tokenizer must hold the actor's (its vocab_size may still
    differ, e.g. another padding, as long as it covers every id)."""
    prm = cfg.prm.model_path
    if cfg.trainer.job != "rl" or not cfg.prm.wanted(cfg) or tokenizer is None or not prm or not Path(prm).is_dir():
        return []
    folder, actor = Path(prm), Path(cfg.model.tokenizer_path)
    if folder.resolve() == Path(cfg.model.path).resolve():
        return []  # the actor's own model: the same ids as the actor, whatever it tokenizes with
    problems = vocab_problem(tokenizer, cfg, model_path=prm, field="prm.model_path")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return problems  # nothing to compare with: the vocabulary check above is all there is
    try:
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=cfg.model.trust_remote_code).get_vocab()
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad tokenizer folder
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return problems + [f"prm.model_path: '{folder}': its tokenizer does not load ({type(e).__name__}: {reason}); "
                           "valid: the actor's tokenizer, or none (the PRM reads the actor's token ids)"]
    ours = tokenizer.get_vocab()
    if ours == theirs:
        return problems
    first = next((t for t in sorted(ours, key=ours.get) if theirs.get(t) != ours[t]), None)
    if first is None:  # theirs has tokens ours lacks
        first = min((t for t in theirs if t not in ours), key=theirs.get)
        what = f"token {first!r} is id {theirs[first]} for the PRM and not in the actor's"
    elif first in theirs:
        what = f"token {first!r} is id {ours[first]} for the actor and {theirs[first]} for the PRM"
    else:
        what = f"token {first!r} (id {ours[first]} for the actor) is not in the PRM's"
    return problems + [f"prm.model_path: the tokenizer in '{folder}' differs from the actor's in '{actor}' "
                       f"({len(ours)} vs {len(theirs)} tokens; {what}); the PRM scores the actor's token ids; valid: "
                       "a PRM that shares the actor's tokenizer (prm.model_path, default model.path)"]


def vocab_problem(tokenizer, cfg, model_path: Optional[str] = None, field: str = "model.tokenizer_path") -> List[str]:
    """A tokenizer whose ids reach past config.json's vocab_size would index outside the embedding
    (of model.path, or of `model_path`: another model that reads the actor's token ids)."""
    from verl_hpc.models.config_mapping import load_hf_config

    model_path = model_path or cfg.model.path
    try:
        vocab_size = load_hf_config(model_path).get("vocab_size")
    except ConfigError:
        return []  # reported with the model folder
    if not isinstance(vocab_size, int):
        return []
    ids = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if ids <= vocab_size:
        return []
    return [f"{field}: the tokenizer in '{cfg.model.tokenizer_path}' has ids up to {ids - 1} "
            f"({len(tokenizer)} tokens with the added ones), but '{Path(model_path) / 'config.json'}' has "
            f"vocab_size = {vocab_size}; valid: a tokenizer whose ids are all < vocab_size (the model's own)"]


# ------------------------------------------------------------------------------ lora.init_from
def init_from_check(cfg, values: bool):
    """The AdapterCheck of the job's lora.init_from (models/peft_adapter.py), None without one.
    values: read the tensors too (NaN / inf, and q/k/v's A); the submitter does, a rank's early
    check does not (it reads them once, to load them). An actor on the FSDP engine loads the
    adapter through PEFT itself, which computes any adapter PEFT wrote: its check is
    models/peft_folder.py (the tensors against the base are the engine's check)."""
    if not (cfg.lora.enabled and cfg.lora.init_from):
        return None
    from verl_hpc.models.config_mapping import load_arch
    from verl_hpc.models.lora import AdapterSpec
    from verl_hpc.models.peft_adapter import AdapterCheck, check_adapter

    if _actor_engine(cfg) == "fsdp":
        from verl_hpc.models.peft_folder import folder_problems

        lora = cfg.lora
        sync = lora.syncs_adapter(cfg, "hf" if cfg.rollout.engine == "hf" else "vllm",
                                  gpu=cfg.slurm.gpus_per_node > 0)
        return AdapterCheck(*folder_problems(lora.init_from, lora, adapter_sync=sync))
    try:
        arch = load_arch(cfg.model.path)
    except ConfigError:
        arch = None  # the model folder's own check reports it; the adapter's shapes are not checked
    return check_adapter(cfg.lora.init_from, AdapterSpec.from_config(cfg.lora), arch, values=values)


def _actor_engine(cfg) -> str:
    """megatron | fsdp: the engine parallel.engine picks for the actor (the Megatron check when
    the folder cannot be read: its own check reports that)."""
    from verl_hpc.config.sections.fsdp import choose_engine

    try:
        return choose_engine(cfg.parallel.engine, cfg.model.path, cfg.parallel)
    except (ConfigError, OSError):
        return "megatron"
