"""Dropout off in the policy's forward passes: RL's importance ratio pi / pi_old and the
rollout/training mismatch both assume that the rollout (vLLM or HF generate, no dropout), the old
log-probs (a no-grad forward in eval mode, no dropout) and the update (a forward in train mode)
compute one function. A folder whose config.json keeps its pretraining dropout (GPT-2's 0.1) would
train a randomly thinned network against the others' full one. TRL does the same by default
(`disable_dropout`); here `model.disable_dropout` (default true) says it, and false keeps the
folder's values on the FSDP engine.

Two places hold dropout in a transformers model: the config's rates, which the modules read when
they are built and, for attention, at every forward (`attention_dropout` and its kin); and
`torch.nn.Dropout` modules. Both are zeroed: the config before the model is built (on every
sub-config of a vision-language model), the modules after it, for model code that fixes a rate of
its own.
"""
from __future__ import annotations

from typing import List

import torch

# float config fields that are dropout rates in transformers' configs: attention_dropout,
# hidden_dropout, resid_pdrop, embd_pdrop, attn_pdrop, residual_dropout, embedding_dropout,
# classifier_dropout, summary_first_dropout, ...
_RATE_WORDS = ("dropout", "pdrop")


def zero_config_dropout(config) -> List[str]:
    """Set every dropout rate of a transformers config (and its sub-configs) to 0; the names of
    those that were not 0 (`text_config.attention_dropout` for a sub-config's)."""
    changed = []
    for name, value in list(vars(config).items()):
        if any(w in name for w in _RATE_WORDS) and isinstance(value, float) and not isinstance(value, bool):
            if value != 0.0:
                changed.append(name)
            setattr(config, name, 0.0)
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            changed += [f"{key}.{n}" for n in zero_config_dropout(sub)]
    return changed


def zero_module_dropout(model: torch.nn.Module) -> int:
    """p = 0 on every torch.nn.Dropout of the model; how many had p > 0."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            n += int(m.p > 0)
            m.p = 0.0
    return n
