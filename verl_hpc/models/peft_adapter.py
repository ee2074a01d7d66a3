"""A PEFT adapter folder (`lora.init_from`) against the job: does the engine compute with it what
PEFT computes?

    found = check_adapter(folder, spec, arch, values=True)     # submit, before the queue
    found.problems, found.damaged                              # one line each; [] = loads exactly
    found = check_adapter(folder, spec, arch, values=True, keep=True)   # a rank: + found.tensors

The engine's adapter is `W x + scale * B A x` on every decoder layer's targeted linear layers, one
r and one scale everywhere. An adapter that means anything else must be refused, not loaded as
something else (a DoRA adapter loaded without its magnitude vectors, or an rsLoRA one scaled by
alpha / r, computes another model with no word said). So, with PEFT's own config class and the
safetensors library:

- adapter_config.json: JSON that `peft.LoraConfig` takes, peft_type LORA; r, lora_alpha and
  use_rslora equal to lora.rank, lora.alpha and lora.use_rslora; its target modules, matched by
  PEFT's own rule (lists, regexes and exclude_modules as PEFT reads them), select the job's
  targets' HF modules in every decoder layer and nothing else; no option the engine does not
  compute: use_dora (magnitude vectors), rank_pattern and alpha_pattern (another r or alpha per
  module), and any other field away from PEFT's default (bias, modules_to_save,
  layers_to_transform, ...), each named;
- adapter_model.safetensors: readable (a truncated or damaged file is named), exactly the tensors
  the job's adapter has (an unused one is named, as is a missing one), of the shapes the base's
  config.json and r imply, floating point;
- values (`values=True`): finite (the first tensor holding NaN or inf is named), and whether the A
  of q/k/v (gate/up) are equal: a stock PEFT adapter's are not, and loads with one A per module
  (models/lora.py, `per_module_a`); this project's own exports share one.

An adapter is small next to its base (rank 32 on every target of a 70B model: 1.7 GB in fp32),
so reading its values on the login node takes seconds; a rank reads them once, to load them.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from verl_hpc.models.lora import AdapterSpec
from verl_hpc.models.lora_names import HF_MODULES, factor_hf_entries

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# adapter_config.json fields that do not change what the stored adapter computes: metadata; dropout
# (training only: the job's lora.dropout applies); how A and B were initialised (the file holds
# where they are now; the inits that change the base itself are refused by init_lora_weights);
# qalora_group_size (only with use_qalora) and ensure_weight_tying (only with modules_to_save or
# trainable tokens), whose own fields are checked
NO_EFFECT = frozenset({"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
                       "revision", "inference_mode", "lora_dropout", "runtime_config", "megatron_core",
                       "qalora_group_size", "ensure_weight_tying", "loftq_config", "eva_config", "corda_config",
                       "lora_ga_config"})
# checked one by one below (exclude_modules is part of PEFT's target matching)
CHECKED = frozenset({"r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "use_dora",
                     "rank_pattern", "alpha_pattern", "init_lora_weights"})
# initialisations that leave the base model as it is (pissa, olora, loftq and corda rewrite the base's
# weights at init: such an adapter belongs to a base other than model.path)
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


@dataclasses.dataclass
class AdapterCheck:
    problems: List[str]  # the adapter is not one the job's engine computes as PEFT does
    damaged: List[str]  # the weights file cannot be read, or holds NaN / inf
    per_module_a: Optional[bool] = None  # with values: some q/k/v (gate/up) A differ
    tensors: Optional[Dict[str, torch.Tensor]] = None  # with keep: every tensor, read

    @property
    def ok(self) -> bool:
        return not (self.problems or self.damaged)

    def raise_first(self) -> None:
        """A rank's refusal, one line: WeightFileError (exit code 13) for a damaged file or
        non-finite values, else a ConfigError with the first problem (the submitter lists all)."""
        from verl_hpc.config.errors import ConfigError
        from verl_hpc.models.hf_checkpoint import WeightFileError

        if self.damaged:
            raise WeightFileError(self.damaged[0])
        if self.problems:
            more = (f" (and {len(self.problems) - 1} more: `submit --dry-run` lists them)"
                    if len(self.problems) > 1 else "")
            raise ConfigError(self.problems[0] + more)


def check_adapter(folder, spec: AdapterSpec, arch, *, values: bool, keep: bool = False) -> AdapterCheck:
    """Everything the module docstring lists, for the adapter folder `folder` and the job's
    adapter `spec` (rank, alpha, use_rslora, targets) on the base `arch` (None: the base's
    config.json is unreadable, reported elsewhere; the tensors' shapes are not checked then)."""
    folder = Path(folder)
    where = f"lora.init_from: '{folder}'"
    if not folder.is_dir():
        return AdapterCheck([f"{where} is not a folder; valid: a PEFT adapter folder ({CONFIG} + {WEIGHTS})"], [])
    missing = [n for n in (CONFIG, WEIGHTS) if not (folder / n).is_file()]
    if missing:
        bin_only = (folder / "adapter_model.bin").is_file()
        alt = " (adapter_model.bin is not read: save with safe_serialization)" if bin_only else ""
        return AdapterCheck([f"{where} has no {' and no '.join(missing)}{alt}; valid: a PEFT adapter folder "
                             f"({CONFIG} + {WEIGHTS})"], [])
    problems = config_problems(folder / CONFIG, spec, arch.num_layers if arch is not None else 1)
    header, damaged = _header(folder / WEIGHTS)
    found = AdapterCheck(problems, damaged)
    if header is None:
        return found
    # names and shapes follow from r and the targets: against a config already refused they would
    # only repeat its problem
    expected = _expected(spec, arch) if arch is not None and not problems else None
    found.problems += _tensor_problems(folder / WEIGHTS, header, expected)
    if values and not found.damaged and expected is not None and not found.problems:
        _read_values(folder / WEIGHTS, spec, arch, found, keep)
    return found


# ----------------------------------------------------------------------------- adapter_config.json
def config_problems(path: Path, spec: AdapterSpec, layers: int) -> List[str]:
    from peft import LoraConfig

    where = f"lora.init_from: '{path}'"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"{where} is not readable JSON ({e}); valid: the {CONFIG} PEFT writes"]
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else type(raw).__name__
        return [f"{where}: peft_type {kind!r}; valid: a LoRA adapter (peft_type LORA)"]
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    # a key this PEFT does not know is a feature of a newer one: harmless while it is off
    unknown = sorted(k for k, v in raw.items() if k not in fields and v not in (None, False, {}, [], ""))
    if unknown:
        return [f"{where}: {', '.join(unknown)} = {', '.join(repr(raw[k]) for k in unknown)}: options this "
                f"PEFT does not know (newer than the installed one?), so the engine cannot compute them"]
    try:
        config = LoraConfig(**{k: v for k, v in raw.items() if k in fields and k != "runtime_config"})
    except (TypeError, ValueError) as e:
        return [f"{where}: peft.LoraConfig refuses it: {str(e).splitlines()[0] if str(e) else type(e).__name__}"]
    problems = _option_problems(where, config)
    if config.r != spec.rank:
        problems.append(f"{where}: r = {config.r}, this job has lora.rank = {spec.rank}: set lora.rank = {config.r}")
    if float(config.lora_alpha) != float(spec.alpha):
        problems.append(f"{where}: lora_alpha = {config.lora_alpha}, this job has lora.alpha = {spec.alpha} (the "
                        f"adapter's output scale): set lora.alpha = {config.lora_alpha}")
    if bool(config.use_rslora) != bool(spec.use_rslora):
        problems.append(f"{where}: use_rslora = {str(config.use_rslora).lower()} (scale alpha / "
                        f"{'sqrt(r)' if config.use_rslora else 'r'}), this job has lora.use_rslora = "
                        f"{str(spec.use_rslora).lower()}: set lora.use_rslora = {str(config.use_rslora).lower()}")
    return problems + _target_problems(where, config, spec, layers)


def _option_problems(where: str, config) -> List[str]:
    from peft import LoraConfig

    problems = []
    if config.use_dora:
        problems.append(f"{where}: use_dora = true (DoRA: a learned magnitude per output, which the engine's "
                        "adapters do not have); valid: a plain LoRA adapter (use_dora false)")
    for name, what in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        if getattr(config, name):
            problems.append(f"{where}: {name} = {getattr(config, name)!r} gives some modules another {what}; the "
                            f"engine's adapters have one r and one alpha (lora.rank, lora.alpha); valid: {name} empty")
    if config.init_lora_weights not in PLAIN_INITS:
        problems.append(f"{where}: init_lora_weights = {config.init_lora_weights!r} rewrites the base model's weights "
                        f"at init, so this adapter belongs to another base than model.path; valid: "
                        f"{', '.join(repr(v) for v in PLAIN_INITS)} (PEFT converts such an adapter to plain LoRA "
                        "with path_initial_model_for_weight_conversion)")
    default = LoraConfig()
    for f in dataclasses.fields(LoraConfig):
        if f.name in NO_EFFECT or f.name in CHECKED:
            continue
        value, plain = getattr(config, f.name), getattr(default, f.name)
        if value != plain and not (value in (None, {}, []) and plain in (None, {}, [])):
            problems.append(f"{where}: {f.name} = {value!r}: the engine does not compute this option; valid: "
                            f"PEFT's default ({plain!r})")
    return problems


def _target_problems(where: str, config, spec: AdapterSpec, layers: int) -> List[str]:
    """The modules PEFT's own matching selects, against the job's targets in every layer."""
    from peft.tuners.tuners_utils import check_target_module_exists

    if config.target_modules is None:
        return [f"{where}: target_modules is null; valid: the job's targets' modules "
                f"({', '.join(m.rpartition('.')[2] for t in spec.targets for m in HF_MODULES[t])})"]
    modules = [m for t in HF_MODULES.values() for m in t]

    def selected(key: str) -> bool:  # PEFT's "excluded" marker is falsy
        return bool(check_target_module_exists(config, key))

    # every layer alike, unless a regex (or layers_to_transform, refused above) picks layers
    per_layer = [tuple(m for m in modules if selected(f"model.layers.{i}.{m}")) for i in range(layers)]
    outside = [k for k in ("lm_head", "model.embed_tokens") if selected(k)]
    if outside:
        return [f"{where}: target_modules select {', '.join(outside)}; the engine adapts decoder layers' linear "
                "layers only; valid: q/k/v/o_proj, gate/up/down_proj"]
    other = next((i for i, mods in enumerate(per_layer) if mods != per_layer[0]), None)
    if other is not None:
        return [f"{where}: target_modules select other modules in layer {other} than in layer 0; the engine "
                "adapts every decoder layer alike"]
    chosen = set(per_layer[0])
    targets, partial = [], []
    for target, group in HF_MODULES.items():
        held = [m for m in group if m in chosen]
        if len(held) == len(group):
            targets.append(target)
        elif held:
            partial.append(f"{', '.join(h.rpartition('.')[2] for h in held)} without "
                           f"{', '.join(m.rpartition('.')[2] for m in group if m not in held)}")
    if partial:
        return [f"{where}: target_modules select {'; '.join(partial)}: Megatron fuses them into one layer "
                "(linear_qkv: q/k/v_proj; linear_fc1: gate/up_proj), adapted whole; valid: all of a fused "
                "layer's modules or none"]
    if sorted(targets) != sorted(spec.targets):
        names = sorted(h.rpartition(".")[2] for h in chosen)
        return [f"{where}: target_modules select {names or 'no decoder module'}, this job has "
                f"lora.target_modules = {list(spec.targets)}: set lora.target_modules = {targets}"]
    return []


# ----------------------------------------------------------------------------- adapter_model.safetensors
def _header(path: Path) -> Tuple[Optional[Dict[str, Tuple[Tuple[int, ...], str]]], List[str]]:
    """({name: (shape, dtype)}, []) or (None, [why the file is unreadable]), from the header alone
    (safetensors checks that the tensors cover the file exactly: a cut copy is caught here)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}, []
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
        why = str(e).strip() or type(e).__name__
        return None, [f"lora.init_from: '{path}' is not a readable safetensors file ({why}): truncated or damaged; "
                      "valid: the adapter_model.safetensors PEFT writes"]


def _expected(spec: AdapterSpec, arch) -> Dict[str, Tuple[int, ...]]:
    return {name: shape for layer in range(arch.num_layers) for target in spec.targets for factor in "AB"
            for name, shape in factor_hf_entries(arch, target, factor, layer, spec.rank)}


def _tensor_problems(path: Path, header, expected) -> List[str]:
    where = f"lora.init_from: '{path}'"
    problems = []
    if expected is not None:
        unused = sorted(set(header) - set(expected))
        if unused:
            problems.append(f"{where} holds tensor '{unused[0]}'{_more(unused)}, which the job's adapter does not "
                            "use (another module, a bias, modules_to_save, DoRA's magnitude?); valid: lora_A and "
                            "lora_B of the targeted modules only")
        absent = [n for n in expected if n not in header]
        if absent:
            problems.append(f"{where} has no tensor '{absent[0]}'{_more(absent)}, which the job's adapter needs "
                            "(lora.target_modules, every decoder layer)")
        wrong = [n for n in expected if n in header and header[n][0] != expected[n]]
        if wrong:
            n = wrong[0]
            problems.append(f"{where}: tensor '{n}' has shape {list(header[n][0])}; lora.rank and the base's "
                            f"config.json imply {list(expected[n])}{_more(wrong)}")
    ints = sorted(n for n, (_, dtype) in header.items() if dtype not in FLOAT_DTYPES)
    if ints:
        problems.append(f"{where}: tensor '{ints[0]}' has dtype {header[ints[0]][1]}{_more(ints)}; valid: "
                        f"{', '.join(FLOAT_DTYPES)}")
    return problems


def _read_values(path: Path, spec: AdapterSpec, arch, found: AdapterCheck, keep: bool) -> None:
    """Every tensor finite; whether the A of a fused layer's modules differ (found.per_module_a)."""
    from safetensors import safe_open

    bad, tensors = [], {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not torch.isfinite(t).all():
                    bad.append(name)
                if keep or ".lora_A." in name:
                    tensors[name] = t
    except Exception as e:  # noqa: BLE001 - the header read, but the data did not (I/O error)
        found.damaged.append(f"lora.init_from: '{path}': reading its tensors failed ({e})")
        return
    if bad:
        found.damaged.append(f"lora.init_from: '{path}': tensor '{bad[0]}' holds NaN or inf{_more(bad)}; valid: "
                             "finite values (the adapter diverged or was damaged: start from an earlier one)")
        return
    found.per_module_a = _a_differ(tensors, spec, arch)
    if keep:
        found.tensors = tensors


def _a_differ(tensors, spec: AdapterSpec, arch) -> bool:
    for layer in range(arch.num_layers):
        for target in spec.targets:
            names = [n for n, _ in factor_hf_entries(arch, target, "A", layer, spec.rank)]
            if any(not torch.equal(tensors[n], tensors[names[0]]) for n in names[1:]):
                return True
    return False


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""
