"""PromptBatch: the prompts of one step, as the trainer hands them to rollout and rewards."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Sequence


@dataclass
class PromptBatch:
    """Parallel lists, one entry per prompt. Token ids are unpadded lists: rollout engines take them
    as they are, and padding belongs to whoever builds tensors from them."""

    ids: List[str] = field(default_factory=list)  # stable sample ids, "<file name>:<row>"
    prompt_ids: List[List[int]] = field(default_factory=list)
    prompt_texts: List[str] = field(default_factory=list)  # after the chat template
    data_sources: List[str] = field(default_factory=list)
    ground_truths: List[str] = field(default_factory=list)
    extras: List[Dict[str, Any]] = field(default_factory=list)
    # a vision-language model's prompts: per prompt its images (verl_hpc.data.processor.PromptImages,
    # None for a prompt without any); empty for a text-only model
    media: List[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def __post_init__(self):
        sizes = {len(v) for v in (self.ids, self.prompt_ids, self.prompt_texts, self.data_sources,
                                  self.ground_truths, self.extras) + ((self.media,) if self.media else ())}
        if len(sizes) > 1:
            raise ValueError(f"PromptBatch: fields of unequal lengths {sorted(sizes)}")

    def select(self, indices: Sequence[int]) -> "PromptBatch":
        """The prompts at `indices`, in that order."""
        return PromptBatch(**{f.name: [getattr(self, f.name)[i] for i in indices] if getattr(self, f.name) else []
                              for f in fields(self)})

    @classmethod
    def concat(cls, batches: Sequence["PromptBatch"]) -> "PromptBatch":
        joined = {f.name: [x for b in batches for x in getattr(b, f.name)] for f in fields(cls) if f.name != "media"}
        if any(b.media for b in batches):  # a batch of text prompts has no entries: None per prompt
            joined["media"] = [m for b in batches for m in (b.media or [None] * len(b))]
        return cls(**joined)
