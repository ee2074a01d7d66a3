"""`python -m verl_hpc.checkpoint export CKPT --hf OUT`: a trainer checkpoint's actor as a Hugging
Face folder (safetensors, config.json, tokenizer files) that `transformers` loads.

One process, no Megatron, no torch.distributed: the checkpoint's names are layout independent
(verl_hpc/engines/megatron/state.py), so each HF tensor is read whole from the index, whatever
TP/PP/DP wrote it, converted with the HF <-> Megatron rules of verl_hpc.models.weight_rules, and
written one tensor at a time (memory: one shard of `--shard-gb`, not the model).

    actor/model/embedding.word_embeddings.weight        -> model.embed_tokens.weight (real vocab rows)
    actor/model/decoder.layers.{i}.self_attention.linear_qkv.weight (query-group order)
                                                        -> model.layers.{i}.self_attn.{q,k,v}_proj.weight
    actor/model/decoder.layers.{i}.mlp.linear_fc1.weight/gate, .../up
                                                        -> model.layers.{i}.mlp.{gate,up}_proj.weight
    ... (norms, o_proj, down_proj, final norm, lm_head unless tied)

config.json and the tokenizer come from the model folder the run trained (`model.path`,
`model.tokenizer_path` in the checkpoint's resolved config), or from `--model` when that folder
is elsewhere on this machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import yaml

from verl_hpc.checkpoint.errors import CheckpointError
from verl_hpc.checkpoint.load import CheckpointReader
from verl_hpc.models.config_mapping import load_arch
from verl_hpc.models.weight_rules import LAYER_RULES, Layout, model_rules

log = logging.getLogger(__name__)

WEIGHT_FILES = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.h5|\.msgpack|\.gguf)$|\.index\.json$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


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
    names = sorted(n for n in reader.tensors() if n.startswith(prefix))
    if not names:
        roots = sorted({n.split("/")[0] for n in reader.tensors()})
        raise CheckpointError(f"{reader.path}: no tensors under {prefix!r} (top-level names: {roots})")
    lay = Layout(tp_rank=0, tp=1, padded_vocab=arch.vocab_size)
    top = model_rules(arch)
    for full_name in names:
        name = full_name[len(prefix):]
        tensor = reader.load_tensor(full_name)
        if name == "value_head.weight":
            raise CheckpointError(f"{reader.path}: {prefix!r} is a value model (critic); export the actor")
        m = _LAYER.match(name)
        if m and m.group(2) in ("mlp.linear_fc1.weight/gate", "mlp.linear_fc1.weight/up"):
            part = m.group(2).rsplit("/", 1)[1]
            yield f"model.layers.{m.group(1)}.mlp.{part}_proj.weight", tensor
            continue
        if m and m.group(2) in LAYER_RULES:
            rule, layer = LAYER_RULES[m.group(2)], int(m.group(1))
        elif name in top:
            rule, layer = top[name], None
        else:
            raise CheckpointError(f"{reader.path}: no HF name for {full_name!r} ({arch.family}); "
                                  "verl_hpc.models.weight_rules covers Llama/Qwen2/Mistral layers")
        yield from rule.to_hf(tensor, arch, layer, lay)


def export_hf(ckpt, out, *, model: Optional[str] = None, role: str = "actor", shard_gb: float = 5.0) -> Path:
    """Write the HF folder `out` from checkpoint `ckpt` (a directory, or a root: its `latest`)."""
    from safetensors.torch import save_file

    out = Path(out)
    with CheckpointReader(ckpt) as reader:
        src, tok = model_folders(reader, model)
        if not (src / "config.json").is_file():
            raise CheckpointError(f"{src}/config.json not found (the model folder of the run, from the "
                                  "checkpoint's model.path); pass --model FOLDER")
        arch = load_arch(src)
        out.mkdir(parents=True, exist_ok=True)
        limit = int(shard_gb * 1e9)
        shards: List[Dict[str, torch.Tensor]] = [{}]
        size, seen = 0, set()
        tmp_names: List[str] = []

        def flush():
            name = f"model-{len(tmp_names) + 1:05d}.tmp.safetensors"
            save_file(shards[-1], str(out / name), metadata={"format": "pt"})
            tmp_names.append(name)

        for hf_name, t in hf_tensors(reader, arch, prefix=f"{role}/model/"):
            if hf_name in seen:
                raise CheckpointError(f"{reader.path}: two tensors map to {hf_name}")
            seen.add(hf_name)
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > limit:
                flush()
                shards.append({})
                size = 0
            shards[-1][hf_name] = t.contiguous()
            size += nbytes
        flush()
        step = reader.step
    n = len(tmp_names)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(tmp_names, final):
        (out / tmp).replace(out / name)
    if n > 1:
        weight_map = {k: final[i] for i, shard in enumerate(shards) for k in shard}
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    _copy_side_files(src, tok, out)
    log.info("export: step %d of %s -> %s (%d tensors, %d file(s))", step, ckpt, out, len(seen), n)
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
    p.add_argument("--hf", required=True, metavar="OUT", help="Hugging Face folder to write")
    p.add_argument("--model", help="HF folder with config.json and tokenizer (default: the checkpoint's model.path)")
    p.add_argument("--role", default="actor", help="which trained model to export (default: actor)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="max safetensors file size (default 5)")


def run_cli(args: argparse.Namespace) -> int:
    out = export_hf(args.ckpt, args.hf, model=args.model, role=args.role, shard_gb=args.shard_gb)
    print(f"exported {args.ckpt} -> {out}")
    return 0
