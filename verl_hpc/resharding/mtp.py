"""The MTP drafter's weights in the weight sync (rollout.speculative.method = mtp, DeepSeek-V3 family):
this rollout rank's slices of the checkpoint's multi-token-prediction tensors, read once from
model.path, and sent to vLLM's drafter after the policy's weights on every sync.

    frozen = MtpWeights.from_folder(model_path, keeps=(tp_rank, tp), dtype=torch.bfloat16)
    for name, part, need in frozen.slices(): ...      # part = hf[need.start:need.stop] along need.dim
    rollout.load_draft_weights(carriers(frozen.slices(), frozen.shapes))   # (resharding/sync.py)

What is synced, what is frozen (docs/speculative.md, "The proposer kept in step with the policy"):
- the MTP layers' embedding and output head: vLLM's drafter uses the target's own modules in their
  place (rollout/speculative/drafter.py, SHARED), so they are the policy's, moved by the ordinary sync; the
  checkpoint's stored copies are accounted for here as shared (`MtpLayout.shared`) and never sent.
- everything else of the MTP layers (enorm, hnorm, eh_proj, shared_head.norm and the block's latent
  attention, router, shared and routed experts): frozen at the checkpoint's values. The training
  engines do not build MTP layers (models/deepseek.py drops them; Megatron-Core's MTP block is not
  built here), so nothing trains them and there is no trained value to send.

Why send frozen values at all: vLLM allocates the drafter's weights in the same memory pool as the
target's, and a level-2 sleep (the trainer's rollout.sleep_level default) drops both; the policy's
load (reload_weights) reaches the target model only. So the sync after every wake must restore them.
Without a level-2 sleep the values sent equal those vLLM loaded at build: the load is a refresh, at
the cost of this rank's MTP slices (about 1/60 of DeepSeek-V3's 671B parameters, over rollout.tp).

A separate draft model (method draft_model with draft_model_path) is frozen the same way and for the
same reason (`MtpWeights.from_draft_model`): every tensor its folder stores is its own (vLLM's
DraftModelProposer shares neither embedding nor head with the target, and builds it at the target's
TP), cut by the decoder layers' rules with its vocabulary by the padded rows, re-sent after every sync.

Slicing: RolloutSlicer (resharding/plan.py), the rules the sliced sync uses for the decoder layers,
unchanged: vLLM builds the MTP block as a DeepseekV2DecoderLayer, so its latent attention (q_a_proj and
kv_a_proj_with_mqa replicated, q_b_proj and kv_b_proj by rows, o_proj by columns), router (replicated),
shared and routed experts (gate/up rows, down columns) and norms (whole) are cut as the decoder's. The
MTP extras: enorm, hnorm and shared_head.norm are norms (whole); eh_proj is a plain nn.Linear in
vLLM's DeepSeekMultiTokenPredictorLayer, not a parallel layer, so every rank keeps all of it
(`MTP_REPLICATED`). Each rank reads only its slices (safetensors slice reads) and keeps them in host
memory, in the rollout's dtype, for the run.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from verl_hpc.config.hf_model import read_hf_config
from verl_hpc.config.sections.speculative import mtp_layers
from verl_hpc.resharding.plan import Need, PlanError, RolloutSlicer
from verl_hpc.rollout.speculative.drafter import shared_with_policy, split_mtp_name
from verl_hpc.rollout.weights import checkpoint_weight_names, mtp_weight_names, stored_weight_names

log = logging.getLogger(__name__)
# model types whose MTP layers are laid out and served as above (vLLM's DeepSeekMTP); another family
# speculating with mtp keeps its drafter's weights as vLLM loaded them (said once in the log)
SYNCED_TYPES = ("deepseek_v3",)
_said = set()
# vLLM's DeepSeekMultiTokenPredictorLayer.eh_proj is torch.nn.Linear: no TP split
MTP_REPLICATED = re.compile(r"^model\.layers\.\d+\.eh_proj\.weight$")


@dataclasses.dataclass(frozen=True)
class MtpLayout:
    """The MTP layers a folder stores: `frozen` {name: full shape} (the drafter's own tensors) and
    `shared` {stored name: the policy's name vLLM uses in its place}; every stored MTP tensor is in
    exactly one of them."""

    folder: str
    decoder_layers: int
    layers: Tuple[int, ...]
    frozen: Dict[str, Tuple[int, ...]]
    shared: Dict[str, str]


def mtp_layout(model_path: str | Path) -> Optional[MtpLayout]:
    """The folder's MTP layout from config.json (num_hidden_layers, num_nextn_predict_layers) and the
    safetensors index or headers; None when config.json declares no MTP layers. Raises ValueError
    when it declares them and stores none (an export: vLLM's drafter would have nothing to load)."""
    from verl_hpc.models.hf_checkpoint import HFCheckpointReader

    config = read_hf_config(model_path)
    count = mtp_layers(config)
    if not count:
        return None
    decoder = int(config.get("num_hidden_layers") or 0)
    stored = sorted(mtp_weight_names(model_path, stored_weight_names(model_path)))
    layers = tuple(range(decoder, decoder + count))
    held = {split_mtp_name(n)[0] for n in stored}
    if not held:
        raise ValueError(f"rollout.speculative.method = mtp: '{model_path}' declares num_nextn_predict_layers = "
                         f"{count} but stores no tensor of layers {layers[0]}..{layers[-1]} (an export without "
                         "them); use the released checkpoint's folder, or another method")
    if not held <= set(layers):
        raise ValueError(f"'{model_path}': stored layers {sorted(held - set(layers))} are past the "
                         f"{decoder} decoder and {count} MTP layers config.json declares")
    frozen, shared = {}, {}
    with HFCheckpointReader(model_path) as reader:
        for name in stored:
            policy = shared_with_policy(name)
            if policy is None:
                frozen[name] = reader.shape(name)
            else:
                shared[name] = policy
    return MtpLayout(str(model_path), decoder, layers, frozen, shared)


def mtp_need(slicer: RolloutSlicer, name: str, shape, tp_rank: int) -> Tuple[int, int, int]:
    """(dim, start, stop) of the MTP tensor `name` that inference-TP rank `tp_rank` keeps."""
    if slicer.tp > 1 and MTP_REPLICATED.match(name):
        return 0, 0, shape[0]
    return slicer.need(name, shape, tp_rank)


class MtpWeights:
    """One rollout rank's frozen MTP slices, read from the folder on first use and kept."""

    def __init__(self, layout: MtpLayout, keeps: Tuple[int, int], dtype: Optional[torch.dtype],
                 slicer: RolloutSlicer, what: str = "MTP layer"):
        self.layout, self.keeps, self.dtype, self.slicer = layout, tuple(keeps), dtype, slicer
        self.what = what  # names the drafter in errors and in the log
        self.shapes = dict(layout.frozen)
        self.bytes_read = 0
        self._kept: Optional[List[Tuple[str, torch.Tensor, Need]]] = None

    @classmethod
    def from_folder(cls, model_path: str | Path, keeps: Tuple[int, int],
                    dtype: Optional[torch.dtype]) -> "MtpWeights":
        from verl_hpc.models.vocab_tensors import folder_geometry

        layout = mtp_layout(model_path)
        if layout is None:
            raise ValueError(f"rollout.speculative.method = mtp: '{model_path}' has no multi-token-prediction "
                             "layers (config.json num_nextn_predict_layers)")
        head_dim, vocab_size = folder_geometry(model_path)
        # the vocabulary tensors are the shared ones, never among the frozen: no vocabulary rule applies
        return cls(layout, keeps, dtype, RolloutSlicer(keeps[1], head_dim=head_dim, vocab_size=vocab_size, vocab=()))

    @classmethod
    def from_draft_model(cls, folder: str | Path, keeps: Tuple[int, int],
                         dtype: Optional[torch.dtype]) -> "MtpWeights":
        """A separate draft model's every stored tensor, frozen (rollout.speculative.draft_model_path)."""
        from verl_hpc.models.hf_checkpoint import HFCheckpointReader
        from verl_hpc.models.vocab_tensors import LLAMA, folder_geometry, folder_vocab_names

        with HFCheckpointReader(folder) as reader:
            frozen = {n: reader.shape(n) for n in sorted(checkpoint_weight_names(folder))}
        layers = int(read_hf_config(folder).get("num_hidden_layers") or 0)
        head_dim, vocab_size = folder_geometry(folder)
        vocab = folder_vocab_names(folder) if keeps[1] > 1 else LLAMA  # (tp 1 keeps every tensor whole)
        return cls(MtpLayout(str(folder), layers, tuple(range(layers)), frozen, {}), keeps, dtype,
                   RolloutSlicer(keeps[1], head_dim=head_dim, vocab_size=vocab_size, vocab=vocab),
                   what="draft model (rollout.speculative.draft_model_path)")

    def slices(self) -> Iterator[Tuple[str, torch.Tensor, Need]]:
        """(name, this rank's part, its Need) of every frozen tensor, in name order."""
        if self._kept is None:
            self._kept = self._read()
        yield from self._kept

    @property
    def nbytes(self) -> int:
        """This rank's frozen slices, in bytes (what one sync sends the drafter)."""
        return sum(p.numel() * p.element_size() for _, p, _ in self.slices())

    def _read(self) -> List[Tuple[str, torch.Tensor, Need]]:
        from verl_hpc.models.hf_checkpoint import HFCheckpointReader

        tp_rank, tp = self.keeps
        out = []
        with HFCheckpointReader(self.layout.folder) as reader:
            for name, shape in sorted(self.shapes.items()):
                try:
                    dim, start, stop = mtp_need(self.slicer, name, shape, tp_rank)
                except PlanError as exc:
                    raise PlanError(f"{self.what} tensor {exc}") from None
                index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
                part = reader.read(name, index)
                if self.dtype is not None and part.is_floating_point():
                    part = part.to(self.dtype)
                out.append((name, part.contiguous(), Need(tp_rank, name, dim, start, stop)))
            self.bytes_read = reader.bytes_read
        log.info("%s drafter: %d frozen tensors of layers %s, this rank's slices %.1f MB (rollout.tp = %d); "
                 "%d shared with the policy", self.what, len(out), list(self.layout.layers),
                 sum(p.numel() * p.element_size() for _, p, _ in out) / 1e6, tp, len(self.layout.shared))
        return out


def _slices_of(rollout) -> Tuple[Tuple[int, int], Optional[torch.dtype]]:
    """(this rank's (tp_rank, tp), the dtype its engine holds) of `rollout`."""
    keeps = tuple(rollout.weight_slices()) if callable(getattr(rollout, "weight_slices", None)) else (0, 1)
    return keeps, getattr(rollout, "weight_dtype", None)


def draft_source(rollout, cache: Optional[MtpWeights]) -> Optional[MtpWeights]:
    """The frozen drafter's slices for `rollout` (one that drafts with MTP: its `mtp_folder` is set; or
    with a draft model folder: its `draft_folder`), the cached ones while its folder and slices stay the
    same; None for any other rollout."""
    draft = getattr(rollout, "draft_folder", None)
    if isinstance(draft, str) and draft:
        keeps, dtype = _slices_of(rollout)
        if cache is not None and (cache.layout.folder, cache.keeps, cache.dtype) == (draft, keeps, dtype):
            return cache
        return MtpWeights.from_draft_model(draft, keeps, dtype)
    folder = getattr(rollout, "mtp_folder", None)
    if not isinstance(folder, str) or not folder:
        return None
    kind = read_hf_config(folder).get("model_type")
    if kind not in SYNCED_TYPES:
        if folder not in _said:
            _said.add(folder)
            log.warning("MTP drafter of '%s' (model_type %s): its own weights are not synced (the layout is "
                        "checked for %s only); they stay as vLLM loaded them, and a level-2 sleep loses them",
                        folder, kind, ", ".join(SYNCED_TYPES))
        return None
    keeps, dtype = _slices_of(rollout)
    if cache is not None and (cache.layout.folder, cache.keeps, cache.dtype) == (str(folder), keeps, dtype):
        return cache
    return MtpWeights.from_folder(folder, keeps, dtype)


__all__ = ["MTP_REPLICATED", "MtpLayout", "MtpWeights", "draft_source", "mtp_layout", "mtp_need"]
