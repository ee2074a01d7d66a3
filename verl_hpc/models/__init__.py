"""Hugging Face decoder models (Llama, Qwen2, Mistral) as Megatron-Core GPT models.

    arch  = load_arch(cfg.model.path)                     # config.json -> ModelArch (validated)
    model = build_gpt_model(arch)                         # this rank's TP/PP shard, weights empty
    load_hf_weights(model, cfg.model.path)                # reads only this rank's slices
    for name, tensor in export_hf_weights(model): ...     # full HF tensors on every rank

Megatron model parallelism must be initialised first (verl_hpc.parallel.init_model_parallel).
`tiny.make_tiny_model` writes a small random HF model folder for tests and the demo.
"""
from verl_hpc.models.config_mapping import (
    ModelArch,
    check_parallel,
    load_arch,
    load_hf_config,
    padded_vocab_size,
    parse_hf_config,
    transformer_config,
)
from verl_hpc.models.gpt import build_gpt_model, full_vocab_logits, layer_spec
from verl_hpc.models.hf_checkpoint import HFCheckpointReader
from verl_hpc.models.weights import LoadReport, export_hf_weights, load_hf_weights

__all__ = ["HFCheckpointReader", "LoadReport", "ModelArch", "build_gpt_model", "check_parallel",
           "export_hf_weights", "full_vocab_logits", "layer_spec", "load_arch", "load_hf_config",
           "load_hf_weights", "padded_vocab_size", "parse_hf_config", "transformer_config"]
