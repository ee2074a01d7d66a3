"""One micro-batch of the FSDP engine, ready for the model: its rows cut out of the batch
(engines/batch.py select_rows), the tokens each response is scored on, and the model's inputs as
the micro-batch's layout asks for them:

- plain rows: one sequence per row, right-padded; the output layer only from the first scored
  position on (`keep`);
- prompt sharing (`sharing`, sharing.py): a prompt's responses packed after it in one row, with a
  dense attention mask;
- a vision-language model's images: pixel values and grid concatenated per micro-batch, the
  model's own M-RoPE layout (position_ids None);
- sequence parallelism (`sp`, ulysses.py): rows padded to a multiple of sp, this rank's slice of
  the tokens, and where each scored position lies in it.
"""
from __future__ import annotations

from typing import List, Mapping, Optional

import torch

from verl_hpc.data.processor import collate_inputs, token_types
from verl_hpc.engines.batch import response_positions, response_tokens, select_rows
from verl_hpc.engines.fsdp.ulysses import SequenceGroup


class MicroBatch:
    """A micro-batch's sub-batch on the device (`data`, one row per sample: what the loss reads),
    the model's inputs, and the indices the outputs need. Packed (`sharing`): the model's rows
    are the prompts with their responses, `sample_rows` maps each sample to its row."""

    def __init__(self, batch: Mapping[str, torch.Tensor], rows: List[int], device, sharing=None,
                 image_token_id: Optional[int] = None, sp: Optional[SequenceGroup] = None):
        self.rows, self.dummy, self.sp = rows, not rows, sp
        multiple = sp.size if sp is not None else 1  # under sequence parallelism every rank's slice is equal
        if self.dummy:  # one prompt token, no response: runs the collectives, adds exactly 0
            sub = {"input_ids": torch.zeros(1, max(2, multiple), dtype=torch.long),
                   "prompt_lengths": torch.ones(1, dtype=torch.long),
                   "response_lengths": torch.zeros(1, dtype=torch.long), "response_mask": torch.zeros(1, 1)}
        else:
            sub = select_rows(batch, rows, pad_seq_to=multiple)
        images = collate_inputs(sub.pop("image_inputs", None) or [])
        ids, width = sub["input_ids"], sub["response_mask"].shape[1]
        if image_token_id is not None and not images and bool((ids == image_token_id).any()):
            # the model would read the image tokens as text without a word: a batch that lost its
            # images on the way (a sub-batch that kept only the tensors) trains on the wrong inputs
            raise ValueError(f"micro-batch rows {rows[:8]} hold image tokens (id {image_token_id}) but the "
                             "batch carries no image_inputs for them")
        sub["_targets"] = response_tokens(ids, sub["prompt_lengths"], width)
        packed = sharing(sub, width) if sharing is not None and not self.dummy else None
        self.packed = packed is not None
        self.attention_mask = self.sample_rows = None
        if packed is None:
            inputs = ids
            positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            sub["_positions"] = response_positions(sub["prompt_lengths"], width, ids.shape[1])
        else:
            inputs, positions, sub["_positions"] = packed.input_ids, packed.position_ids, packed.positions
            # True = attends (SDPA's bool mask)
            self.attention_mask = (~packed.dense_mask()).to(device, non_blocking=True)
            self.sample_rows = packed.sample_rows.to(device, non_blocking=True)
        # logits only from the first scored position on (the shortest prompt's last token)
        self.first = int(sub["_positions"].min())
        self.keep = inputs.shape[1] - self.first
        sub["_kept"] = sub["_positions"] - self.first
        # every copy to the device without a wait (a blocking one synchronises the device's stream:
        # the host would wait for the step so far before queuing this micro-batch)
        self.data = {k: v.to(device, non_blocking=True) for k, v in sub.items()}
        self.input_ids = inputs.to(device, non_blocking=True)
        self.position_ids = positions.to(device, non_blocking=True)
        # a vision-language model's micro-batch with images: the model lays out its M-RoPE positions
        # itself from the image tokens and the grid (position_ids=None), and fills the image tokens'
        # embeddings from the vision tower
        self.images = {k: v.to(device, non_blocking=True) for k, v in images.items()}
        if self.images:
            self.images["mm_token_type_ids"] = token_types(self.input_ids, image_token_id)
            self.position_ids = None
        self.tokens = 0.0 if self.dummy else float(sub["response_mask"].sum())
        if sp is not None:
            self._slice(sp)

    def _slice(self, sp: SequenceGroup) -> None:
        """Sequence parallelism: this rank's tokens of every row, and where each scored position
        of the [b, T] response layout lies in them (`_local`: its index in the slice, `_mine`:
        whether this rank holds it)."""
        first, end = sp.bounds(self.input_ids.shape[1])
        pos = self.data["_positions"]
        self.data["_mine"] = ((pos >= first) & (pos < end)).float()
        self.data["_local"] = (pos - first).clamp(0, end - first - 1)
        self.input_ids, self.position_ids = sp.slice(self.input_ids), sp.slice(self.position_ids)
