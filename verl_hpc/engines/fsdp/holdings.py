"""What this rank holds of each HF tensor under FSDP, for the sliced weight sync
(verl_hpc.resharding.sliced: the plan sends each rollout rank exactly its slices, from the ranks
that hold them, with no full gather).

FSDP2 shards every parameter along dim 0, so a rank's part of an HF tensor is one row range (an
empty one when there are more ranks than rows): exactly a `Piece` along dim 0. Under HSDP every
replica holds the same ranges; the replica index is the plan's data-parallel rank, so a rollout
rank takes its slices from its own replica where it can.
"""
from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

from verl_hpc.engines.fsdp.state import local_rows
from verl_hpc.models.weight_rules import Piece


class FsdpHoldings:
    def __init__(self, engine):
        self.engine = engine
        self._params = list(engine.model.named_parameters())  # tied weights once, export order

    def entries(self) -> List[Tuple[str, Tuple[int, ...]]]:
        return [(name, tuple(p.shape)) for name, p in self._params]

    def pieces(self) -> Iterator[Piece]:
        for name, p in self._params:
            local, row0 = local_rows(p.detach())
            if local.numel() == 0:
                continue
            yield Piece(name, 0, row0, local)

    def dp_rank(self) -> int:
        mesh = self.engine.mesh
        if mesh.ndim == 1:
            return 0
        return int(mesh.get_local_rank("replicate"))

    def geometry(self) -> Tuple[int, int]:
        cfg = self.engine.hf_config
        text = getattr(cfg, "text_config", None) or cfg
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return int(head_dim), int(text.vocab_size)

    def dtype(self) -> torch.dtype:
        return self._params[0][1].dtype

    def vocab_names(self) -> Tuple[str, ...]:
        """The model's vocabulary tensors by its own accessors (GPT-NeoX's gpt_neox.embed_in, ...)."""
        from verl_hpc.models.vocab_tensors import vocab_names

        return vocab_names(self.engine.model)
