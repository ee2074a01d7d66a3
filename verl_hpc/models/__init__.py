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

# The torch-backed parts load on first use, so that `verl_hpc.models.config_mapping` (config.json
# reading, used by the memory planner on login nodes) imports without torch.
_LAZY = {"build_gpt_model": "gpt", "full_vocab_logits": "gpt", "layer_spec": "gpt",
         "HFCheckpointReader": "hf_checkpoint", "LoadReport": "weights",
         "export_hf_weights": "weights", "load_hf_weights": "weights"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"verl_hpc.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'verl_hpc.models' has no attribute {name!r}")


__all__ = ["HFCheckpointReader", "LoadReport", "ModelArch", "build_gpt_model", "check_parallel",
           "export_hf_weights", "full_vocab_logits", "layer_spec", "load_arch", "load_hf_config",
           "load_hf_weights", "padded_vocab_size", "parse_hf_config", "transformer_config"]
