"""Which tensors of a model are its vocabulary (the input embedding and the output layer), found through
the model's own accessors, not by Llama's names: the rollout engines cut those by rows of the vocabulary
padded to 64 (the sliced weight sync's plan, resharding.plan.RolloutSlicer), whatever the family calls them (GPT-NeoX's
gpt_neox.embed_in / lm_head, Falcon's transformer.word_embeddings, GPT-2's transformer.wte).

    vocab_names(model)          # a transformers model (the FSDP engine's): its parameters' names
    folder_vocab_names(path)    # a model folder (split placement's publisher): its model built on meta
    folder_geometry(path)       # (head_dim, vocabulary size) from its config.json, any family
"""
from __future__ import annotations

import logging
from typing import Tuple

log = logging.getLogger(__name__)
LLAMA = ("model.embed_tokens.weight", "lm_head.weight")  # the Megatron-mapped families' names


def vocab_names(model) -> Tuple[str, ...]:
    """Names of the parameters that are the weights of `model.get_input_embeddings()` and
    `get_output_embeddings()` (a tied pair: both names of the one tensor); Llama's where the model
    has neither accessor."""
    weights = []
    for accessor in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, accessor, None)
        module = get() if callable(get) else None
        weight = getattr(module, "weight", None)
        if weight is not None:
            weights.append(weight)
    names = tuple(n for n, p in model.named_parameters(remove_duplicate=False) if any(p is w for w in weights))
    return names or LLAMA


def folder_vocab_names(model_path) -> Tuple[str, ...]:
    """vocab_names of the folder's causal LM, built on the meta device from its config.json (no weights
    read, nothing allocated); Llama's names where transformers cannot build it (said in the log)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(model_path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - the sliced plan then assumes Llama's names, as before
        log.info("vocabulary tensors of '%s': Llama's names assumed (transformers could not build the "
                 "model on meta: %s: %s)", model_path, type(e).__name__, str(e)[:200])
        return LLAMA
    return vocab_names(model)


def folder_geometry(model_path) -> Tuple[int, int]:
    """(head_dim, vocabulary size) of the folder's language model, from its config.json: what the
    rollout's loaders cut heads and vocabulary rows by (any family; the FSDP engine's holdings say the
    same from the loaded config)."""
    from verl_hpc.config.hf_model import language_model_config, read_hf_config

    text = language_model_config(read_hf_config(model_path))
    heads = text.get("num_attention_heads") or text.get("n_head") or 1
    hidden = text.get("hidden_size") or text.get("n_embd") or 0
    return int(text.get("head_dim") or hidden // heads), int(text["vocab_size"])
