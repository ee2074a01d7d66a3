"""rollout.speculative.draft_layers: self-speculation whose drafter the weight sync keeps in step.

The drafter is the policy cut short: its embedding, its first N decoder layers, its final norm and
its head (LayerSkip's early exit, used as a draft model). vLLM's `draft_model` method takes a model
folder, so the engine writes one (`write_drafter`: config.json with num_hidden_layers = N, the
tokenizer files, the N layers' tensors read from model.path) into a scratch folder of its own,
removed with the engine, and names it as the draft model.

A frozen drafter goes stale as soon as the policy moves (its acceptance fell from 100% to under 50%
in tests/unit/rollout/test_speculative_vllm.py); this one is loaded with the policy's new tensors on
every `load_weights`. The weight stream is a lazy iterator that vLLM's reload of the target
consumes once, so `tap` keeps a copy of the drafter's tensors as they pass (a bucket's buffer may be
reused after it) and `load` hands them to the drafter afterwards, with the stream's own checks
(every drafter tensor, each once). The load is the one vLLM's weight-transfer engines run for a
draft model (`start_draft_weight_update`): `initialize_layerwise_reload` on the worker's draft
model, its `load_weights` with checkpoint names, `finalize_layerwise_reload` with the draft model's
config; those engines need a transfer backend of their own, which this in-process sync does not
use, so the same steps are run through `collective_rpc` by the loader every drafter shares
(rollout/speculative/drafter.py, `load_into_drafter`).

What it costs: the drafter's tensors are held twice during a sync (the copy, then the drafter), and
the folder on local disk holds the same. Refused rather than synced wrong (config section and here):
rollout.tp > 1, the LoRA adapter sync, vLLM's Transformers modelling backend, and checkpoints not
laid out as model.embed_tokens / model.layers.<i>. / model.norm / lm_head.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.hf_model import read_hf_config
from verl_hpc.config.sections.speculative import drafter_names, drafter_problems
from verl_hpc.rollout.speculative import drafter as vllm_drafter
from verl_hpc.rollout.weights import CheckedWeights, checkpoint_weight_names, tied_embeddings

log = logging.getLogger(__name__)
FIELD = "rollout.speculative.draft_layers"
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")


def write_drafter(policy: str, n: int, names: Iterable[str], out: Path) -> Path:
    """The drafter's folder: the policy's config.json with num_hidden_layers = n (and every per-layer
    list, e.g. layer_types, cut to n), its other small files (tokenizer, generation config) as they
    are, and one model.safetensors with the tensors `names` read from the policy's weights."""
    from safetensors.torch import save_file

    from verl_hpc.models.hf_checkpoint import open_safetensors

    src, out = Path(policy), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = read_hf_config(src)
    layers = int(config["num_hidden_layers"])
    for key, value in list(config.items()):
        if isinstance(value, list) and len(value) == layers and key != "architectures":
            config[key] = value[:n]
    config["num_hidden_layers"] = n
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    wanted, tensors = set(names), {}
    for f in sorted(src.glob("*.safetensors")):
        with open_safetensors(f) as handle:
            for name in wanted.intersection(handle.keys()):
                tensors[name] = handle.get_tensor(name)
    if set(tensors) != wanted:
        raise ValueError(f"{FIELD}: '{policy}' lacks {sorted(wanted - set(tensors))[:3]} in its safetensors files")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class DraftSync:
    """The drafter of one engine: its folder, and its share of every weight sync."""

    def __init__(self, model_path: str, layers: int, *, tp: int = 1, lora_rank: int = 0,
                 impl: Optional[str] = None):
        why = ("rollout.tp > 1 (the drafter's TP-sliced load is not built)" if tp > 1 else
               "LoRA slots (the adapter sync never sends the base layers)" if lora_rank else
               "vLLM's Transformers modelling backend" if impl is not None else None)
        if why:
            raise ConfigError(f"{FIELD} = {layers}: not with {why}; set draft_layers = 0")
        names = checkpoint_weight_names(model_path)
        problems = drafter_problems(read_hf_config(model_path), names, layers)
        if problems:
            raise ConfigError(problems[0])
        self.layers = layers
        self.names = drafter_names(names, layers)  # a tied checkpoint has no lm_head: nor does the stream
        self.tied = tied_embeddings(model_path)
        self.kept: Dict[str, torch.Tensor] = {}
        self.folder = Path(tempfile.mkdtemp(prefix="verl_hpc_drafter_"))
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        write_drafter(model_path, layers, self.names, self.folder)
        log.info("rollout.speculative.draft_layers = %d: drafter of %d tensors written to %s, kept in step by "
                 "the weight sync", layers, len(self.names), self.folder)

    @classmethod
    def for_engine(cls, speculative, model_path: str, **kw) -> Optional["DraftSync"]:
        layers, method = getattr(speculative, "draft_layers", 0), getattr(speculative, "method", "off")
        if not layers:
            return None
        if method != "draft_model":
            raise ConfigError(f"{FIELD} = {layers} needs rollout.speculative.method = draft_model (got {method})")
        return cls(str(model_path), layers, **kw)

    def tap(self, stream: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """Pass `stream` on unchanged, keeping a copy of each drafter tensor."""
        self.kept = {}
        for name, tensor in stream:
            if name in self.names:
                self.kept[name] = tensor.detach().clone()
            yield name, tensor

    def load(self, llm) -> int:
        """After the target's reload: the kept tensors into every worker's draft model. Raises if one
        is missing (the stream's checks passed, so only a stream that bypassed `tap` can)."""
        kept, self.kept = self.kept, {}
        checked = CheckedWeights(kept.items(), self.names)
        weights = list(checked)
        checked.finish()
        for missing in llm.collective_rpc(vllm_drafter.load_into_drafter, args=(weights, self.tied, False)):
            if missing:
                raise RuntimeError(f"draft_sync: the draft model's {', '.join(missing[:3])} got no new value "
                                   f"({len(missing)} parameters in all)")
        return len(weights)

    def close(self) -> None:
        self._remove()

