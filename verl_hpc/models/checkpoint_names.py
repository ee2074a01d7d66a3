"""The names a model folder stores its tensors under, against the names transformers gives them once
loaded: transformers 5 renames some on load (its checkpoint conversion mapping: GPT-NeoX's
`embed_out.weight` is the loaded model's `lm_head.weight`). The FSDP engine trains and checkpoints the
loaded model's names; what leaves the project for a folder's reader (an HF export, vLLM's loader) goes
under the folder's names."""
from __future__ import annotations

from typing import Dict, Iterable


def checkpoint_aliases(model_path, stored: Iterable[str]) -> Dict[str, str]:
    """{the model's name: the folder's name} for the stored tensors transformers renames on load
    (its checkpoint conversion mapping for the architecture: GPT-NeoX's `embed_out.weight` is the
    model's `lm_head.weight`). The training engines send the model's names; the rollout checks them
    against the folder's and hands vLLM the folder's, which every vLLM class loads (the backend
    maps them with the same conversion mapping); an HF export writes the folder's names."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    from verl_hpc.config.hf_model import read_hf_config

    config = read_hf_config(model_path)
    renamings = []
    for key in ((config.get("architectures") or [None])[0], config.get("model_type")):
        renamings += [t for t in (get_checkpoint_conversion_mapping(key) or []) if isinstance(t, WeightRenaming)]
    if not renamings:
        return {}
    stored = set(stored)
    out = {}
    for name in sorted(stored):
        new, _ = rename_source_key(name, renamings, [])
        if new != name and new not in stored:
            out[new] = name
    return out


def folder_names(model_path) -> Dict[str, str]:
    """checkpoint_aliases of the folder's own stored tensors (their names from the safetensors headers;
    none read); {} for a folder without readable safetensors files (nothing to keep)."""
    from pathlib import Path

    from verl_hpc.models.safetensors_header import read_header

    stored = set()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        header, problem = read_header(f)
        if problem:
            return {}
        stored.update(k for k in header if k != "__metadata__")
    return checkpoint_aliases(model_path, stored) if stored else {}
