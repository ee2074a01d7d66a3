"""A PEFT adapter folder (`lora.init_from`) for the FSDP engine, which loads it through PEFT itself.

    problems, damaged = folder_problems(folder, lora, adapter_sync=False)   # one line each
    config = read_lora_config(folder, lora)     # peft.LoraConfig, or ConfigError (the first problem)

The Megatron engine computes its own adapter layers, so models/peft_adapter.py refuses whatever
those layers do not compute. The FSDP engine's model is PEFT's (`get_peft_model` with the folder's
own `LoraConfig`, then `load_adapter`), so PEFT computes whatever PEFT wrote: one A per q/k/v
module, rank-stabilised scaling, DoRA's magnitude vectors, a subset of modules (the common
q_proj + v_proj), layers_to_transform. What is still checked, against the job:

- the folder: adapter_config.json and adapter_model.safetensors, JSON that `peft.LoraConfig` takes,
  peft_type LORA, a readable safetensors header;
- r, lora_alpha and use_rslora equal to lora.rank, lora.alpha and lora.use_rslora: the rollout's
  LoRA slot is sized by lora.rank, and checkpoints and exports record the section's values;
- one r and one alpha (no rank_pattern / alpha_pattern: the slot and the checkpoint record hold one);
- an initialisation that leaves the base as it is (pissa, olora, loftq and corda rewrite the base's
  weights when PEFT builds the adapter: this adapter would belong to another base than model.path);
- no option that makes the adapter more than factors on linear layers (modules_to_save, lora_bias,
  trainable tokens, aLoRA, ...): the export, the merged sync and the adapter sync carry factors only;
- DoRA only where the rollout gets merged weights (vLLM's LoRA slots do not serve DoRA).

Which modules the adapter targets, and whether its tensors fit the base's shapes, are checked by
the engine against the model itself (engines/fsdp/lora.py), on every rank before any weight moves.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.peft_adapter import CONFIG, NO_EFFECT, PLAIN_INITS, WEIGHTS, _header

# options PEFT computes and the FSDP engine carries (exports, merges) as they are
TAKEN = frozenset({"r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "exclude_modules",
                   "layers_to_transform", "layers_pattern", "fan_in_fan_out", "init_lora_weights",
                   "rank_pattern", "alpha_pattern"})


def folder_problems(folder, lora, *, adapter_sync: bool = False) -> Tuple[List[str], List[str]]:
    """(problems, damaged) of the adapter folder against the job's lora section; `adapter_sync`:
    the rollout receives the adapter itself (vLLM's LoRA slot)."""
    folder = Path(folder)
    where = f"lora.init_from: '{folder}'"
    if not folder.is_dir():
        return [f"{where} is not a folder; valid: a PEFT adapter folder ({CONFIG} + {WEIGHTS})"], []
    missing = [n for n in (CONFIG, WEIGHTS) if not (folder / n).is_file()]
    if missing:
        alt = (" (adapter_model.bin is not read: save with safe_serialization)"
               if (folder / "adapter_model.bin").is_file() else "")
        return [f"{where} has no {' and no '.join(missing)}{alt}; valid: a PEFT adapter folder "
                f"({CONFIG} + {WEIGHTS})"], []
    config, problems = _parse(folder / CONFIG)
    if config is not None:
        problems += _against_job(f"lora.init_from: '{folder / CONFIG}'", config, lora, adapter_sync)
    _, damaged = _header(folder / WEIGHTS)
    return problems, damaged


def read_lora_config(folder, lora, *, adapter_sync: bool = False):
    """The folder's peft.LoraConfig, checked (module docstring); ConfigError with the first
    problem (WeightFileError for a damaged weights file)."""
    from verl_hpc.models.hf_checkpoint import WeightFileError

    problems, damaged = folder_problems(folder, lora, adapter_sync=adapter_sync)
    if damaged:
        raise WeightFileError(damaged[0])
    if problems:
        more = f" (and {len(problems) - 1} more: `submit --dry-run` lists them)" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)
    config, _ = _parse(Path(folder) / CONFIG)
    return config


def _parse(path: Path):
    from peft import LoraConfig

    where = f"lora.init_from: '{path}'"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, [f"{where} is not readable JSON ({e}); valid: the {CONFIG} PEFT writes"]
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else type(raw).__name__
        return None, [f"{where}: peft_type {kind!r}; valid: a LoRA adapter (peft_type LORA)"]
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    unknown = sorted(k for k, v in raw.items() if k not in fields and v not in (None, False, {}, [], ""))
    if unknown:
        return None, [f"{where}: {', '.join(unknown)} = {', '.join(repr(raw[k]) for k in unknown)}: options "
                      "this PEFT does not know (newer than the installed one?)"]
    try:
        return LoraConfig(**{k: v for k, v in raw.items() if k in fields and k != "runtime_config"}), []
    except (TypeError, ValueError) as e:
        return None, [f"{where}: peft.LoraConfig refuses it: {str(e).splitlines()[0] if str(e) else type(e).__name__}"]


def _against_job(where: str, config, lora, adapter_sync: bool) -> List[str]:
    from peft import LoraConfig

    p = []
    if config.r != lora.rank:
        p.append(f"{where}: r = {config.r}, this job has lora.rank = {lora.rank}: set lora.rank = {config.r}")
    if float(config.lora_alpha) != float(lora.alpha):
        p.append(f"{where}: lora_alpha = {config.lora_alpha}, this job has lora.alpha = {lora.alpha} (the "
                 f"adapter's output scale): set lora.alpha = {config.lora_alpha}")
    if bool(config.use_rslora) != bool(lora.use_rslora):
        rs = str(bool(config.use_rslora)).lower()
        p.append(f"{where}: use_rslora = {rs}, this job has lora.use_rslora = "
                 f"{str(bool(lora.use_rslora)).lower()}: set lora.use_rslora = {rs}")
    for name, what in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        if getattr(config, name):
            p.append(f"{where}: {name} = {getattr(config, name)!r} gives some modules another {what}; the job's "
                     f"adapter has one (lora.rank, lora.alpha: the rollout's LoRA slot, the checkpoint); valid: "
                     f"{name} empty")
    if config.init_lora_weights not in PLAIN_INITS:
        p.append(f"{where}: init_lora_weights = {config.init_lora_weights!r} rewrites the base model's weights "
                 f"when PEFT builds the adapter, so it belongs to another base than model.path; valid: "
                 f"{', '.join(repr(v) for v in PLAIN_INITS)} (PEFT converts such an adapter to plain LoRA with "
                 "path_initial_model_for_weight_conversion)")
    if config.use_dora and adapter_sync:
        p.append(f"{where}: use_dora = true (DoRA), which vLLM's LoRA slots do not serve; set lora.sync = "
                 "merged (the rollout then receives the merged weights)")
    default = LoraConfig()
    for f in dataclasses.fields(LoraConfig):
        if f.name in NO_EFFECT or f.name in TAKEN:
            continue
        value, plain = getattr(config, f.name), getattr(default, f.name)
        if value != plain and not (value in (None, {}, []) and plain in (None, {}, [])):
            p.append(f"{where}: {f.name} = {value!r}: more than low-rank factors on linear layers, which the "
                     f"engine's export and weight sync carry; valid: PEFT's default ({plain!r})")
    return p
