"""LoRA in the FSDP engine, through PEFT: the model is PEFT's own `PeftModelForCausalLM` around the
transformers model, sharded like any other (engine.py), and only the adapters train.

    model, full, adapter = attach_adapters(model, full, options)   # before sharding
    base_names(model)          # (HF name, parameter): base weights under HF names, adapters under PEFT's
    merged_weights(engine)     # (HF name, full tensor): W merged with the adapter (PEFT's merge rule)
    export_adapter(engine)     # (PEFT name, full tensor): what adapter_model.safetensors holds
    adapter_config(engine)     # PEFT's adapter_config.json
    state_meta / check_state_meta   # the adapters' settings and their base in the checkpoint

Attaching: `get_peft_model` with a `LoraConfig` wraps the meta skeleton every rank builds and rank
0's loaded model alike, so both have the same state-dict keys and `materialize` broadcasts rank
0's adapters with its weights. A fresh adapter is the job's lora section (rank, alpha, dropout,
use_rslora; lora.target_modules mapped to the model's own linear layers: `HF_LEAVES`); B starts
at zero and A from the Megatron engine's generator (models/lora.py `init_a`: seeded by
trainer.seed, the layer and the target), so the two engines start from the same adapter (the A of
q, k and v equal, as the fused layer's one A). PEFT then trains one A per module, where the
Megatron engine keeps the fused layers' A tied: after the first update the two differ there.
`lora.init_from` is loaded by PEFT itself (`load_adapter`) with the folder's own LoraConfig, so
any adapter PEFT wrote starts a run (untied q/k/v, rsLoRA, DoRA, a subset of modules), after the
checks of models/peft_folder.py; on every rank the file's tensor names and shapes are compared
with the model's adapters before any weight moves, so a misfit is one ConfigError on every rank.

The reference policy is the same model with the adapters off (`model.disable_adapter()`).
Checkpoints hold the adapters and their Adam moments under PEFT's names (engines/fsdp/state.py);
a checkpoint of the Megatron engine's fused adapters does not resume here, nor the reverse.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import re
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.lora import LORA_TARGETS
from verl_hpc.models.lora import AdapterSpec, init_a
from verl_hpc.engines.fsdp.build import VISION_PARTS, vision_modules

log = logging.getLogger(__name__)
ADAPTER = "default"  # PEFT's adapter name
PEFT_PREFIX = "base_model.model."
# lora.target_modules (Megatron's names) -> the linear layers transformers' models call them, the
# first that a decoder layer has in full: Llama-like names (Llama, Qwen, Mistral, Gemma, OLMo,
# Granite, ...), Phi-3's fused projections, GPT-NeoX / Falcon, Phi-1/2
HF_LEAVES = {"linear_qkv": (("q_proj", "k_proj", "v_proj"), ("qkv_proj",), ("query_key_value",)),
             "linear_proj": (("o_proj",), ("dense",)),
             "linear_fc1": (("gate_proj", "up_proj"), ("gate_up_proj",), ("dense_h_to_4h",), ("fc1",)),
             "linear_fc2": (("down_proj",), ("dense_4h_to_h",), ("fc2",))}
_LAYER = re.compile(r"\.(\d+)\.")


@dataclasses.dataclass
class FsdpAdapter:
    """The engine's adapter: the section's settings (`spec`), the modules PEFT adapts (leaf names),
    DoRA (from an init_from adapter), and the folder it started from."""

    spec: AdapterSpec
    modules: Tuple[str, ...]
    use_dora: bool = False
    init_from: str = ""


# ----------------------------------------------------------------------------- attaching


def _linear_leaves(model: torch.nn.Module) -> Dict[str, str]:
    """{leaf name: Megatron target or ""} of the linear layers in the model's first decoder layer."""
    from verl_hpc.engines.fsdp.build import shard_units

    unit = next((u for u in shard_units(model) if any(isinstance(m, torch.nn.Linear) for m in u.modules())), None)
    if unit is None:
        raise ConfigError(f"lora.rank > 0: {type(model).__name__}'s decoder layers have no linear layers to adapt")
    leaves = {n.rpartition(".")[2] for n, m in unit.named_modules() if isinstance(m, torch.nn.Linear)}
    target_of = {leaf: t for t, options in HF_LEAVES.items() for group in options for leaf in group}
    return {leaf: target_of.get(leaf, "") for leaf in sorted(leaves)}


# PEFT's exclude_modules (a regex over module names): a VLM's vision tower and projector, whose MLPs
# share leaf names (gate_proj, up_proj, down_proj) with the decoder layers'
VISION_EXCLUDE = r".*\.(" + "|".join(VISION_PARTS) + r")\..*"


def target_leaves(model: torch.nn.Module, targets) -> Tuple[str, ...]:
    """PEFT's target_modules for lora.target_modules on this model (ConfigError when the decoder
    layer has no such linear layer)."""
    leaves = _linear_leaves(model)
    out = []
    for target in targets:
        group = next((g for g in HF_LEAVES[target] if all(leaf in leaves for leaf in g)), None)
        if group is None:
            raise ConfigError(f"lora.target_modules = {list(targets)}: {type(model).__name__}'s decoder layers have no "
                              f"{target} ({' / '.join('+'.join(g) for g in HF_LEAVES[target])}); their linear "
                              f"layers: {', '.join(leaves)}; valid: the targets among "
                              f"{', '.join(sorted({t for t in leaves.values() if t}))}")
        out += group
    return tuple(out)


def _fresh_config(lora, leaves):
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(leaves),
                      use_rslora=lora.use_rslora, bias="none", task_type="CAUSAL_LM", init_lora_weights=True)


def _wrap(model: torch.nn.Module, config, field: str):
    """PeftModelForCausalLM around `model`, the adapters trainable, everything else frozen;
    `field` names where the config came from (lora.init_from or lora.target_modules)."""
    from peft import get_peft_model

    config = copy.deepcopy(config)
    config.inference_mode = False  # a saved config says true: its adapters would be frozen
    config.task_type = "CAUSAL_LM"  # the class (PeftModelForCausalLM) whatever the folder says
    try:
        # PEFT draws its default init (and DoRA's) from torch's global generator, on rank 0 only
        # for the loaded model: kept as it was, so every rank's stream stays the same
        with torch.random.fork_rng(devices=[]):
            return get_peft_model(model, config)
    except ValueError as e:  # PEFT's own words: which target modules are missing
        raise ConfigError(f"{field}: PEFT cannot put the adapter on model.path's {type(model).__name__}: "
                          f"{str(e).splitlines()[0]}") from None


def adapted(model) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(module name, PEFT LoRA layer) of every adapted linear layer."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def _seed_a(model, spec: AdapterSpec, seed: int) -> None:
    """Every A from the Megatron engine's generator (module docstring); B stays PEFT's zero."""
    for name, module in adapted(model):
        leaf = name.rpartition(".")[2]
        target = next(t for t, options in HF_LEAVES.items() for g in options if leaf in g)
        m = _LAYER.search(name)
        a = module.lora_A[ADAPTER].weight
        with torch.no_grad():
            a.copy_(init_a(dataclasses.replace(spec, per_module_a=False), a.shape[1], seed,
                           int(m.group(1)) if m else 0, target))


def _check_fit(model, folder: Path) -> None:
    """The adapter file's names and shapes against the wrapped (meta) model's: collective-free, the
    same answer on every rank."""
    from verl_hpc.models.peft_adapter import WEIGHTS, _header

    header, _ = _header(folder / WEIGHTS)
    want = {peft_name(n): tuple(p.shape) for n, p in model.named_parameters() if _is_adapter(n)}
    have = {n: shape for n, (shape, _) in (header or {}).items()}
    where = f"lora.init_from: '{folder / WEIGHTS}'"
    missing = [n for n in want if n not in have]
    if missing:
        raise ConfigError(f"{where} has no tensor '{missing[0]}'{_more(missing)}, which its adapter_config.json "
                          f"puts on model.path's {type(_base(model)).__name__}; is it an adapter of this base?")
    unused = [n for n in have if n not in want]
    if unused:
        raise ConfigError(f"{where} holds tensor '{unused[0]}'{_more(unused)}, which no module of model.path's "
                          f"{type(_base(model)).__name__} takes; is it an adapter of this base?")
    wrong = [n for n in want if have[n] != want[n]]
    if wrong:
        n = wrong[0]
        raise ConfigError(f"{where}: tensor '{n}' has shape {list(have[n])}; model.path's "
                          f"{type(_base(model)).__name__} and its r imply {list(want[n])}{_more(wrong)}: "
                          "an adapter of another base model")


def _load(model, folder: Path) -> None:
    result = model.load_adapter(str(folder), adapter_name=ADAPTER, is_trainable=True)
    if result.missing_keys or getattr(result, "unexpected_keys", None):  # _check_fit said otherwise
        raise ConfigError(f"lora.init_from: '{folder}': PEFT left {len(result.missing_keys)} adapter tensors "
                          f"unloaded and found {len(result.unexpected_keys)} it does not use")


def attach_adapters(model, full, options):
    """(PEFT-wrapped skeleton, PEFT-wrapped full model of rank 0 or None, FsdpAdapter)."""
    from verl_hpc.models.peft_folder import read_lora_config

    lora = options.lora
    spec = dataclasses.replace(AdapterSpec.from_config(lora), per_module_a=True)
    folder = Path(lora.init_from) if lora.init_from else None
    leaves = _linear_leaves(model)  # before PEFT replaces the adapted ones
    if folder is not None:
        config = read_lora_config(folder, lora)
    else:
        config = _fresh_config(lora, target_leaves(model, spec.targets))
    if vision_modules(model):  # a vision-language model: the adapters go on the language model only
        config.exclude_modules = VISION_EXCLUDE
    field = f"lora.init_from: '{folder}'" if folder is not None else "lora.target_modules"
    model = _wrap(model, config, field)
    modules = tuple(sorted({n.rpartition(".")[2] for n, _ in adapted(model)}))
    if folder is not None:
        _check_targets(leaves, modules, spec)
        _check_fit(model, folder)
    if full is not None:
        full = _wrap(full, config, field)
        if folder is not None:
            _load(full, folder)
        else:
            _seed_a(full, spec, options.lora_seed)
        if list(full.state_dict()) != list(model.state_dict()):
            raise RuntimeError("PEFT wrapped the skeleton and the loaded model differently")
    adapter = FsdpAdapter(spec, modules, use_dora=bool(config.use_dora), init_from=str(folder or ""))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA (PEFT) rank %d on %s%s%s: %.3f M trainable parameters", spec.rank, ", ".join(modules),
             ", DoRA" if adapter.use_dora else "", f", from {folder}" if folder else "", trainable / 1e6)
    return model, full, adapter


def _check_targets(leaves: Dict[str, str], modules, spec: AdapterSpec) -> None:
    """An init_from adapter adapts linear layers of the job's lora.target_modules only."""
    outside = [m for m in modules if leaves.get(m, "") not in spec.targets]
    if not outside:
        return
    need = sorted({leaves.get(m, "") for m in outside})
    if "" in need:
        raise ConfigError(f"lora.init_from: its adapter is on {', '.join(outside)}, which are not decoder-layer "
                          f"linear layers the engine adapts ({', '.join(LORA_TARGETS)})")
    raise ConfigError(f"lora.init_from: its adapter is on {', '.join(outside)} ({', '.join(need)}), outside this "
                      f"job's lora.target_modules = {list(spec.targets)}; valid: lora.target_modules naming "
                      f"{', '.join(need)} too")


def _base(model):
    """The transformers model inside PEFT's wrappers."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ----------------------------------------------------------------------------- names


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def peft_name(name: str) -> str:
    """A PeftModel parameter name -> the name PEFT saves it under (get_peft_model_state_dict):
    ...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight; DoRA's
    ...lora_magnitude_vector.default.weight -> ...lora_magnitude_vector."""
    name = re.sub(rf"\.lora_magnitude_vector\.{ADAPTER}\.weight$", ".lora_magnitude_vector", name)
    return name.replace(f".{ADAPTER}", "")


def hf_name(name: str) -> str:
    """A base weight's PeftModel name -> its name in the model's HF folder."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def base_names(model) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """(name, parameter) in the model's order: base weights under their HF names, adapters under
    PEFT's saved names."""
    for name, p in model.named_parameters():
        yield (peft_name(name) if _is_adapter(name) else hf_name(name)), p


# ----------------------------------------------------------------------------- exports


def _full(p: torch.Tensor) -> torch.Tensor:
    data = p.detach()
    return data.full_tensor() if hasattr(data, "full_tensor") else data


def _merge(module, weight: torch.Tensor) -> torch.Tensor:
    """W with the adapter merged, as PEFT's LoraLayer.merge computes it, from full tensors: W +
    scale * B A, or DoRA's m / ||W + scale * B A|| (per output) * (W + scale * B A)."""
    from peft.utils.other import transpose

    a = _full(module.lora_A[ADAPTER].weight).float()
    b = _full(module.lora_B[ADAPTER].weight).float()
    w = weight.float()
    delta = transpose(b @ a, module.fan_in_fan_out) * module.scaling[ADAPTER]
    if module.use_dora.get(ADAPTER, False):
        mag = _full(module.lora_magnitude_vector[ADAPTER].weight).float()
        norm = module.lora_magnitude_vector[ADAPTER].get_weight_norm(w, delta, scaling=1).detach()
        return (transpose((mag / norm).view(-1, 1), module.fan_in_fan_out) * (w + delta)).to(weight.dtype)
    return (w + delta).to(weight.dtype)


def merged_weights(engine) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every base weight, the adapter merged in while it is on, in the
    model's order; a collective (each tensor an all-gather over the mesh), every rank alike."""
    owners = {f"{name}.base_layer.weight": m for name, m in adapted(engine.model)}
    for name, p in engine.model.named_parameters():
        if _is_adapter(name):
            continue
        full = _full(p)
        module = owners.get(name)
        if module is not None and not module.disable_adapters:
            full = _merge(module, full)
        yield hf_name(name), full


def export_adapter(engine) -> Iterator[Tuple[str, torch.Tensor]]:
    """(PEFT name, full fp32 tensor) of every adapter tensor, on every rank (a collective)."""
    for name, p in engine.model.named_parameters():
        if _is_adapter(name):
            yield peft_name(name), _full(p).float()


def adapter_config(engine) -> dict:
    """adapter_config.json as PEFT's save_pretrained writes it, for this engine's adapter."""
    config = copy.deepcopy(engine.model.peft_config[ADAPTER])
    config.base_model_name_or_path = str(engine.options.model_path)
    config.inference_mode = True
    out = config.to_dict()
    out.pop("runtime_config", None)
    return {k: (sorted(v) if isinstance(v, set) else v.value if isinstance(v, enum.Enum) else v)
            for k, v in out.items()}


# ----------------------------------------------------------------------------- checkpoints


def state_meta(engine) -> dict:
    """The Megatron engine's record (rank, alpha, targets, use_rslora, base path and fingerprint)
    and what PEFT adds here: the adapted modules, DoRA, and PEFT's adapter_config.json (what
    `checkpoint export --peft` writes)."""
    from verl_hpc.engines.megatron.lora import state_meta as megatron_meta

    a = engine.lora
    return dict(megatron_meta(a.spec, engine.options.model_path), engine="fsdp", modules=list(a.modules),
                use_dora=a.use_dora, peft_config=adapter_config(engine))


def check_state_meta(engine, saved: Optional[dict]) -> None:
    """Refuse a checkpoint whose adapters do not fit this engine (CheckpointLayoutError, one line):
    adapters into full-weight training or the reverse, the Megatron engine's adapters, another
    rank, alpha, targets or base (the Megatron engine's rules), or other modules or DoRA (another
    lora.init_from)."""
    from verl_hpc.checkpoint.errors import CheckpointLayoutError
    from verl_hpc.engines.megatron.lora import check_state_meta as megatron_check

    a = engine.lora
    megatron_check(saved, a.spec if a is not None else None, engine.options.model_path, engine="fsdp")
    if a is None:
        return
    mine = state_meta(engine)
    for key in ("modules", "use_dora"):
        if saved.get(key) != mine[key]:
            raise CheckpointLayoutError(f"the checkpoint's adapters have {key} = {saved.get(key)}, this job's "
                                        f"{mine[key]}: resume with the lora.init_from it was started from")


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""
