"""`python -m verl_hpc.checkpoint export CKPT --hf OUT`: a trainer checkpoint's actor as a Hugging
Face folder (safetensors, config.json, tokenizer files) that `transformers` loads.
`--peft OUT`: a LoRA run's adapter as a PEFT folder; `--hf` of a LoRA run merges its adapter into
the base weights read from the model folder (the checkpoint holds the adapter only).

One process, no Megatron, no torch.distributed: the checkpoint's names are layout independent
(verl_hpc/engines/megatron/state.py), so each HF tensor is read whole from the index, whatever
TP/PP/DP wrote it, converted with the HF <-> Megatron rules of verl_hpc.models.weight_rules, and
written one tensor at a time (memory: one shard of `--shard-gb`, not the model). The FSDP engine
writes the same names for the families Megatron maps, so its checkpoints export alike; for any
other architecture its names are the HF ones (engine meta `coords: hf`), written as they are.

    actor/model/embedding.word_embeddings.weight        -> model.embed_tokens.weight (real vocab rows)
    actor/model/decoder.layers.{i}.self_attention.linear_qkv.weight (query-group order)
                                                        -> model.layers.{i}.self_attn.{q,k,v}_proj.weight
    actor/model/decoder.layers.{i}.mlp.linear_fc1.weight/gate, .../up
                                                        -> model.layers.{i}.mlp.{gate,up}_proj.weight
    actor/model/decoder.layers.{i}.mlp.experts.{e}.linear_fc1.weight/gate, ... (an MoE model's
    expert e; the router, the shared expert and its gate likewise, by the rules of models/moe.py)
    ... (norms, o_proj, down_proj, final norm, lm_head unless tied)
    a Qwen2.5-VL's decoder likewise under model.language_model.*, its tower's visual.* as model.visual.*

config.json and the tokenizer come from the model folder the run trained (`model.path`,
`model.tokenizer_path` in the checkpoint's resolved config), or from `--model` when that folder
is elsewhere on this machine. A LoRA merge reads the base weights from there too, and first checks
that folder against the base fingerprint the checkpoint recorded (checkpoint/base_model.py, the
check a resume makes). Where the export may write (never into a folder it reads from; into a
folder that is not empty only with --overwrite, which then holds exactly the new model):
checkpoint/export_target.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import yaml

from verl_hpc.checkpoint.base_model import check_base_model
from verl_hpc.checkpoint.errors import CheckpointError
from verl_hpc.checkpoint.export_target import (WEIGHT_FILES, check_target, make_folder, remove_stale,
                                               same_folder, shard_limit)
from verl_hpc.checkpoint.load import CheckpointReader
from verl_hpc.config.errors import ConfigError
from verl_hpc.models.checkpoint_names import folder_names
from verl_hpc.models.config_mapping import load_arch
from verl_hpc.models.vlm_arch import hf_name
from verl_hpc.models.weight_rules import EXPERT_RULES, Layout, layer_rules, model_rules

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")


def model_folders(reader: CheckpointReader, model: Optional[str] = None) -> Tuple[Path, Path]:
    """(model folder, tokenizer folder) for the export, from `--model` or the checkpoint's config."""
    if model:
        return Path(model), Path(model)
    text = reader.metadata.get("config")
    cfg = yaml.safe_load(text) if isinstance(text, str) else None
    path = ((cfg or {}).get("model") or {}).get("path")
    if not path:
        raise CheckpointError(f"{reader.path}: no model.path in the checkpoint's config; "
                              "pass --model FOLDER (the HF folder the run started from)")
    tok = cfg["model"].get("tokenizer_path") or path
    return Path(path), Path(tok)


def hf_tensors(reader: CheckpointReader, arch, prefix: str = "actor/model/") -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every model tensor of the role under `prefix`, read whole."""
    names = sorted(n for n in reader.tensors() if n.startswith(prefix) and ".lora_" not in n)
    if not names:
        roots = sorted({n.split("/")[0] for n in reader.tensors()})
        raise CheckpointError(f"{reader.path}: no tensors under {prefix!r} (top-level names: {roots})")
    lay = Layout(tp_rank=0, tp=1, padded_vocab=arch.vocab_size)
    top = model_rules(arch)
    rename = (lambda n: n) if arch.vision is None else hf_name  # Qwen2.5-VL: transformers 5's names
    for full_name in names:
        name = full_name[len(prefix):]
        tensor = reader.load_tensor(full_name)
        if name == "value_head.weight":
            raise CheckpointError(f"{reader.path}: {prefix!r} is a value model (critic); export the actor")
        if arch.vision is not None and name.startswith("visual."):  # the tower, under its own names
            yield "model." + name, tensor
            continue
        m = _LAYER.match(name)
        rule, layer, part = _layer_rule(m.group(2), arch) if m else (top.get(name), None, None)
        if m:
            layer = int(m.group(1))
        if rule is None:
            raise CheckpointError(f"{reader.path}: no HF name for {full_name!r} ({arch.family}); "
                                  "verl_hpc.models.weight_rules covers Llama/Qwen2/Mistral layers and "
                                  "the Mixtral/Qwen2-MoE/Qwen3-MoE experts")
        if part is not None:  # linear_fc1 saved as its gate and up rows (layout independent)
            gate, up = (n for n, _ in rule.hf_entries(arch, layer))
            yield rename(gate if part == "gate" else up), tensor
            continue
        yield from ((rename(n), t) for n, t in rule.to_hf(tensor, arch, layer, lay))


def engine_meta(reader: CheckpointReader, role: str = "actor") -> dict:
    """The role's engine meta (format, coords, architecture, ...), {} when the checkpoint has none."""
    engines = (reader.metadata.get("trainer_state") or {}).get("engines") or {}
    return engines.get(role) or {}


def named_tensors(reader: CheckpointReader, prefix: str = "actor/model/") -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, tensor) of a checkpoint in HF coordinates (the FSDP engine's state of an
    architecture outside Megatron's mapping: verl_hpc/engines/fsdp/state.py): the names as they
    are, each read whole. A tied output layer is not among them, as in HF's own folders."""
    names = sorted(n for n in reader.tensors() if n.startswith(prefix))
    if not names:
        roots = sorted({n.split("/")[0] for n in reader.tensors()})
        raise CheckpointError(f"{reader.path}: no tensors under {prefix!r} (top-level names: {roots})")
    for full_name in names:
        name = full_name[len(prefix):]
        if name == "score.weight":
            raise CheckpointError(f"{reader.path}: {prefix!r} is a value model (critic); export the actor")
        yield name, reader.load_tensor(full_name)


def _layer_rule(suffix: str, arch):
    """(rule, None, part) of a layer-local logical name: part "gate" / "up" for linear_fc1's halves
    (dense MLP, shared expert or routed expert); a routed expert's rule bound to its index."""
    base, _, part = suffix.partition("/")
    expert = _EXPERT.match(base)
    if expert and arch.moe is not None and expert.group(2) in EXPERT_RULES:
        rule = dataclasses.replace(EXPERT_RULES[expert.group(2)], expert=int(expert.group(1)))
    else:
        rule = layer_rules(arch).get(base)
    return rule, None, (part or None)


def read_folders(reader: CheckpointReader, src: Path, tok: Path, lora: Optional[dict]) -> Dict[Path, str]:
    """{folder: what it is} for every folder an export of `reader` reads, or that the run depends on:
    none of them may be written (export_target.check_target)."""
    out: Dict[Path, str] = {}  # a folder named twice keeps its first (weightiest) reason
    if lora:
        out[Path(lora["base_path"])] = "the base model the checkpoint's adapters were trained on (a resume needs it)"
    text = reader.metadata.get("config")
    cfg = yaml.safe_load(text) if isinstance(text, str) else None
    run_model = ((cfg or {}).get("model") or {}).get("path") if isinstance(cfg, dict) else None
    if run_model:
        out.setdefault(Path(run_model), "the run's model.path (its reference model and a resume read it)")
    out.setdefault(src, "the model folder this export reads config.json" + (" and the base weights" if lora else "")
                   + " from")
    out.setdefault(tok, "the tokenizer folder this export reads")
    return out


def _check(reader: CheckpointReader, out, option: str, model: Optional[str], role: str,
           overwrite: bool) -> Tuple[Path, Path, Optional[dict]]:
    """(model folder, tokenizer folder, LoRA record) once `out` is known to be a valid target."""
    src, tok = model_folders(reader, model)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src}/config.json not found (the model folder of the run, from the "
                              "checkpoint's model.path); pass --model FOLDER")
    lora = lora_meta(reader, role)
    check_target(Path(out), option, overwrite=overwrite, reads=read_folders(reader, src, tok, lora),
                 checkpoint=reader.path)
    return src, tok, lora


def export_hf(ckpt, out, *, model: Optional[str] = None, role: str = "actor", shard_gb: float = 5.0,
              overwrite: bool = False) -> Path:
    """Write the HF folder `out` from checkpoint `ckpt` (a directory, or a root: its `latest`).
    `out` must be new or empty unless `overwrite` (export_target.py has the rules)."""
    from safetensors.torch import save_file

    out = Path(out)
    limit = shard_limit(shard_gb)
    with CheckpointReader(ckpt) as reader:
        src, tok, lora = _check(reader, out, "--hf", model, role, overwrite)
        if lora:  # the merge reads the base weights: they must be those the adapters were trained on
            check_base_model(lora, str(src), "--model" if model else "model.path")
        # an FSDP checkpoint in HF names (an architecture outside Megatron's mapping) is written as it
        # is; the FSDP engine's adapters need no Megatron mapping either: PEFT's names on any architecture
        hf_coords = engine_meta(reader, role).get("coords") == "hf" and not lora
        arch = None if hf_coords or (lora and lora.get("peft_config")) else load_arch(src)
        if lora and arch is not None and arch.vision is not None:  # one line: not built (docs/vlm.md)
            raise CheckpointError(f"--hf: a LoRA adapter of the VLM {src} is not merged here; use --peft and PEFT")
        make_folder(out, "--hf")
        shard: Dict[str, torch.Tensor] = {}
        sizes: List[Dict[str, int]] = []  # per written shard: tensor name -> bytes (the index)
        size, seen = 0, set()
        tmp_names: List[str] = []

        def flush():
            name = f"model-{len(tmp_names) + 1:05d}.tmp.safetensors"
            tmp_names.append(name)
            try:
                save_file(shard, str(out / name), metadata={"format": "pt"})
            except OSError as e:
                raise CheckpointError(f"--hf: cannot write '{out / name}': {e.strerror or e}") from None
            sizes.append({k: t.numel() * t.element_size() for k, t in shard.items()})
            shard.clear()  # memory: one shard at a time, not the model

        if hf_coords:  # under the source folder's names where transformers renamed them on load
            renamed = folder_names(src)  # (GPT-NeoX's head: lm_head.weight in the model, embed_out.weight stored)
            source = ((renamed.get(n, n), t) for n, t in named_tensors(reader, prefix=f"{role}/model/"))
        elif lora:
            source = merged_tensors(reader, arch, src, lora, role)
        else:
            source = hf_tensors(reader, arch, prefix=f"{role}/model/")
        try:
            for hf_name, t in source:
                if hf_name in seen:
                    raise CheckpointError(f"{reader.path}: two tensors map to {hf_name}")
                seen.add(hf_name)
                nbytes = t.numel() * t.element_size()
                if shard and size + nbytes > limit:
                    flush()
                    size = 0
                shard[hf_name] = t.contiguous()
                size += nbytes
            flush()
        except BaseException:  # leave no half-written shard behind
            for name in tmp_names:
                (out / name).unlink(missing_ok=True)
            raise
        step = reader.step
    n = len(tmp_names)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    try:
        # the earlier model's files go only now that the new shards are on disk
        stale = remove_stale(out, keep=tmp_names)
        for tmp, name in zip(tmp_names, final):
            (out / tmp).replace(out / name)
        if n > 1:
            weight_map = {k: final[i] for i, names in enumerate(sizes) for k in names}
            total = sum(b for names in sizes for b in names.values())
            (out / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        _copy_side_files(src, tok, out)
    except OSError as e:
        raise CheckpointError(f"--hf: cannot finish the export in '{out}': {e}") from None
    if stale:
        log.info("export: removed the earlier model's %s from %s", ", ".join(stale), out)
    log.info("export: step %d of %s -> %s (%d tensors, %d file(s))", step, ckpt, out, len(seen), n)
    return out


# ----------------------------------------------------------------------------- LoRA checkpoints

_LORA = re.compile(r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(linear_\w+)\.lora_([AB])(?:/(gate|up))?$")


def lora_meta(reader: CheckpointReader, role: str = "actor") -> Optional[dict]:
    """The role's adapter record (rank, alpha, targets, base) when its checkpoint holds LoRA
    adapters only (lora.rank > 0), else None."""
    return engine_meta(reader, role).get("lora")


def adapter_tensors(reader: CheckpointReader, arch, lora: dict,
                    prefix: str = "actor/model/") -> Iterator[Tuple[str, torch.Tensor]]:
    """(PEFT name, tensor) of every adapter factor under `prefix`, read whole (`lora`: the role's
    adapter record, lora_meta; with per_module_a a fused layer's A holds one A per HF module)."""
    from verl_hpc.models.lora_names import factor_peft_name, factor_rule, to_peft

    names = sorted(n for n in reader.tensors() if n.startswith(prefix) and ".lora_" in n)
    if not names:
        raise CheckpointError(f"{reader.path}: no LoRA adapters under {prefix!r}: it was saved with "
                              "lora.rank = 0; export it with --hf")
    if lora.get("engine") == "fsdp":  # the FSDP engine's adapters: PEFT's own names and tensors
        for full_name in names:
            yield full_name[len(prefix):], reader.load_tensor(full_name)
        return
    lay = Layout(tp_rank=0, tp=1, padded_vocab=arch.vocab_size)
    for full_name in names:
        m = _LORA.match(full_name[len(prefix):])
        if m is None:
            raise CheckpointError(f"{reader.path}: {full_name!r} is no adapter factor this version knows")
        layer, target, factor, part = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        tensor = reader.load_tensor(full_name)
        if part:  # linear_fc1's B, saved as its gate and up rows (layout independent)
            yield factor_peft_name(f"model.layers.{layer}.mlp.{part}_proj.weight", factor), tensor
        else:
            rule = factor_rule(target, factor, bool(lora.get("per_module_a", False)))
            yield from to_peft(rule, tensor, arch, layer, lay, factor)


def merged_tensors(reader: CheckpointReader, arch, base: Path, lora: dict,
                   role: str = "actor") -> Iterator[Tuple[str, torch.Tensor]]:
    """The base model's HF tensors from its folder, each adapted one merged with its adapter
    (W + scale * B A, computed in fp32, written in W's dtype; scale alpha / r, or alpha / sqrt(r)
    with use_rslora). A DoRA adapter (the FSDP engine's, from a PEFT lora.init_from) scales each
    output row by its magnitude over that row's norm, as PEFT's merge does."""
    from verl_hpc.config.sections.lora import lora_scale
    from verl_hpc.models.hf_checkpoint import HFCheckpointReader
    from verl_hpc.models.lora_names import PEFT_PREFIX

    adapter = dict(adapter_tensors(reader, arch, lora, prefix=f"{role}/model/"))
    scale = lora_scale(float(lora["alpha"]), int(lora["rank"]), bool(lora.get("use_rslora", False)))
    fan_in_fan_out = bool((lora.get("peft_config") or {}).get("fan_in_fan_out", False))  # GPT-2's Conv1D: W is [in, out]
    hf = HFCheckpointReader(base)
    try:
        for name in hf.weight_map:
            w = hf.read(name)
            stem = PEFT_PREFIX + name[: -len(".weight")] if name.endswith(".weight") else None
            a, b = (adapter.get(f"{stem}.lora_{f}.weight") for f in "AB") if stem else (None, None)
            if a is not None:
                delta = scale * (b.float() @ a.float())
                merged = w.float() + (delta.T if fan_in_fan_out else delta)
                magnitude = adapter.get(f"{stem}.lora_magnitude_vector")
                if magnitude is not None:  # DoRA: m / ||W + scale B A|| per output
                    rows = merged.T if fan_in_fan_out else merged
                    factor = (magnitude.float() / torch.linalg.norm(rows, dim=1)).view(-1, 1)
                    merged = (factor * rows).T if fan_in_fan_out else factor * rows
                w = merged.to(w.dtype)
            yield name, w
    finally:
        hf.close()


def export_peft(ckpt, out, *, model: Optional[str] = None, role: str = "actor", overwrite: bool = False) -> Path:
    """Write the PEFT adapter folder `out` (adapter_config.json + adapter_model.safetensors) of a
    LoRA checkpoint: `peft.PeftModel.from_pretrained(base, out)` loads it onto the HF base.
    `out` must be new or empty unless `overwrite` (export_target.py has the rules)."""
    from safetensors.torch import save_file

    from verl_hpc.models.lora_names import peft_config

    out = Path(out)
    with CheckpointReader(ckpt) as reader:
        lora = lora_meta(reader, role)
        if lora is None:
            raise CheckpointError(f"{reader.path}: the {role} was trained without LoRA (lora.rank = 0): "
                                  "there is no adapter to export; use --hf")
        if model or reader.metadata.get("config"):
            src, _, _ = _check(reader, out, "--peft", model, role, overwrite)
        else:  # an adapter-only record: its base's config.json gives the shapes
            src = Path(lora["base_path"])
            check_target(out, "--peft", overwrite=overwrite, checkpoint=reader.path,
                         reads={src: "the base model the checkpoint's adapters were trained on"})
        # the FSDP engine's adapters are PEFT's as they are, its record holds PEFT's own config
        arch = None if lora.get("peft_config") else load_arch(src)
        # clone: the A shared by q/k/v (gate/up) is one tensor, which safetensors refuses to write thrice
        tensors = {n: t.clone() for n, t in adapter_tensors(reader, arch, lora, prefix=f"{role}/model/")}
        config = lora.get("peft_config") or peft_config(
            int(lora["rank"]), float(lora["alpha"]), lora["targets"], use_rslora=bool(lora.get("use_rslora", False)),
            base_model=str(lora["base_path"]))
        make_folder(out, "--peft")
        try:
            save_file(tensors, str(out / "adapter_model.safetensors.tmp"), metadata={"format": "pt"})
            remove_stale(out, keep=[])  # an earlier model's or adapter's files (with --overwrite)
            (out / "adapter_model.safetensors.tmp").replace(out / "adapter_model.safetensors")
            (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
        except OSError as e:
            (out / "adapter_model.safetensors.tmp").unlink(missing_ok=True)
            raise CheckpointError(f"--peft: cannot write the adapter into '{out}': {e.strerror or e}") from None
        log.info("export: the %s adapter of step %d (rank %d, %d tensors) -> %s", role, reader.step,
                 config["r"], len(tensors), out)
    return out


def _copy_side_files(src: Path, tok: Path, out: Path) -> None:
    """config.json, generation config and tokenizer files; never the source's weights."""
    for folder in dict.fromkeys([src, tok]):
        for f in folder.iterdir():
            if f.is_file() and not WEIGHT_FILES.search(f.name) and (folder == src or f.name != "config.json"):
                shutil.copy2(f, out / f.name)


# registered as `export` in verl_hpc/checkpoint/__main__.py (imported from there, not the reverse:
# under `python -m` that module runs as __main__, and a second import would be another registry)
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", metavar="OUT", help="Hugging Face folder to write (a LoRA run's: base + adapter merged)")
    p.add_argument("--peft", metavar="OUT", help="a LoRA run's adapter as a PEFT folder (adapter_config.json + "
                                                 "adapter_model.safetensors)")
    p.add_argument("--model", help="HF folder with config.json and tokenizer (default: the checkpoint's model.path); "
                                   "a LoRA merge checks it is the base the adapters were trained on")
    p.add_argument("--role", default="actor", help="which trained model to export (default: actor)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="max safetensors file size (default 5)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a folder that is not empty: its model files (weights, index, config, tokenizer) "
                        "are replaced; never the folders the export reads from")


def run_cli(args: argparse.Namespace) -> int:
    if not (args.hf or args.peft):
        raise CheckpointError("export: say what to write: --hf OUT (a Hugging Face model folder) and/or "
                              "--peft OUT (a LoRA run's adapter)")
    shard_limit(args.shard_gb)
    if args.hf and args.peft and same_folder(Path(args.hf), Path(args.peft)):
        raise ConfigError(f"--hf and --peft both name '{args.hf}'; valid: two different folders (a merged "
                          "model and an adapter are read differently)")
    if args.hf and args.peft:  # both targets checked before either is written
        with CheckpointReader(args.ckpt) as reader:
            for option, out in (("--hf", args.hf), ("--peft", args.peft)):
                _check(reader, out, option, args.model, args.role, args.overwrite)
    if args.peft:
        out = export_peft(args.ckpt, args.peft, model=args.model, role=args.role, overwrite=args.overwrite)
        print(f"exported the adapter of {args.ckpt} -> {out}")
    if args.hf:
        out = export_hf(args.ckpt, args.hf, model=args.model, role=args.role, shard_gb=args.shard_gb,
                        overwrite=args.overwrite)
        print(f"exported {args.ckpt} -> {out}")
    return 0
