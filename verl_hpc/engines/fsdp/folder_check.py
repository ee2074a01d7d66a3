"""Checks of a model folder the FSDP engine builds with transformers, run before the queue (the
submitter, launcher/preflight.py) and again where the engine builds the model.

- The policy (and a teacher or PRM, which read the policy's tokens the same way) must be a causal
  language model: the class config.json names must be one transformers lists as a causal LM (or an
  image-text-to-text model). A masked LM (BertForMaskedLM) would otherwise be built through the
  mapping's decoder class and fail in generate with an AttributeError far from its cause.
- The stored tensors' shapes against the model transformers builds from config.json (on the meta
  device: no memory): a config.json edited after saving (another intermediate_size) is one line
  naming the tensor, the file and both shapes, instead of transformers' mismatched-sizes traceback
  in the job. Tensors transformers renames on load (its checkpoint conversions) are not compared.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

from verl_hpc.config.errors import ConfigError

HeaderShapes = Dict[str, Tuple[Tuple[int, ...], str]]  # tensor name -> (shape, file name)


def _classes():
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())


def causal_lm_problem(config, field: str, path: str) -> str:
    """'' when config.json names a causal-LM class (or none, or ships its own code), else one line."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs or getattr(config, "auto_map", None):
        return ""
    valid = _classes()
    if any(a in valid for a in archs):
        return ""
    return (f"{field}: '{path}' is a {archs[0]} ({config.model_type}), not a causal language model; the policy "
            f"generates and is trained token by token: valid: a folder whose config.json names a causal-LM class "
            f"of transformers (*ForCausalLM, e.g. {', '.join(_examples(valid))}) or an image-text-to-text model")


def _examples(valid) -> List[str]:
    return [n for n in ("LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel") if n in valid]


def shape_problems(config, model_class, field: str, folder: Path, found: HeaderShapes,
                   trust_remote_code: bool = False) -> List[str]:
    """The folder's tensors whose shapes differ from the model `model_class` builds from `config`:
    one line, the first by name, with how many more."""
    import torch

    try:
        with torch.device("meta"):
            model = model_class.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build: its own line
        raise ConfigError(f"{field}: transformers cannot build the model of '{folder}' from its config.json "
                          f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    built = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = sorted(n for n, shape in built.items() if n in found and found[n][0] != shape)
    if not wrong:
        return []
    name = wrong[0]
    more = f" (and {len(wrong) - 1} more tensors disagree)" if len(wrong) > 1 else ""
    return [f"{field}: tensor '{name}' in '{folder / found[name][1]}' has shape {list(found[name][0])}; "
            f"'{folder / 'config.json'}' builds {list(built[name])}{more}; valid: the config.json these weights "
            "were saved with"]
