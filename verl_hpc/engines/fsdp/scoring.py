"""The FSDP engine's model call on one micro-batch and its per-token outputs.

    out = score(engine, mb, ("log_probs", "entropy"))   # {name: [b, T]} (a value head: [b, T] or [b])

Three ways, picked per micro-batch:

- chunked (head.py): where the output layer scores more tokens than one chunk, the lm_head itself
  returns each scored token's results, and the whole logits never exist;
- whole logits: the causal LM is called with `logits_to_keep` = the positions from the
  micro-batch's shortest prompt on (the model's own head then runs only there, with its own
  soft-capping or scaling); log-probs are log_softmax(logits / temperature) at the sampled tokens
  in fp32, entropy and sum-pi-squared the same distribution's;
- a sequence slice (fsdp.sp > 1, ulysses.py): the model on this rank's slice of the tokens, the
  results placed in the `[b, T]` response layout where this rank holds the position and summed
  over the group.

A value head gives per-position values (engines/outputs.py).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from verl_hpc.algorithms import entropy_from_logits, sum_pi_squared_from_logits
from verl_hpc.engines.fsdp.microbatch import MicroBatch
from verl_hpc.engines.outputs import value_outputs

LM_OUTPUTS = ("log_probs", "entropy", "sum_pi_squared")  # the last: the optimal token baseline's, forward only


def check_lm_outputs(want: Sequence[str]) -> None:
    unknown = set(want) - set(LM_OUTPUTS)
    if unknown:
        raise ValueError(f"a language-model engine gives {LM_OUTPUTS}; asked for {sorted(unknown)}")


def score(engine, mb: MicroBatch, want: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The model on one micro-batch -> outputs `[b, T]` (or `[b]`), with grad if enabled."""
    model, head = engine.model, engine._head
    if engine.options.head == "value":
        values = model(mb.input_ids, position_ids=mb.position_ids)
        return value_outputs(values, mb.data, want)
    if mb.sp is not None:
        return score_slice(engine, mb, want)
    check_lm_outputs(want)
    if head is not None and head.takes(mb.data["_targets"].numel()):
        kept = mb.data["_kept"]
        rows = mb.sample_rows if mb.packed else torch.arange(kept.shape[0], device=kept.device)
        with head.scoring(rows.unsqueeze(1), kept, mb.data["_targets"], want):
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                        attention_mask=mb.attention_mask, logits_to_keep=mb.keep, **mb.images)
        return head.results(out, want)
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                attention_mask=mb.attention_mask, logits_to_keep=mb.keep, **mb.images)
    logits = out.logits if hasattr(out, "logits") else out[0]
    kept = mb.data["_kept"]
    b = (mb.sample_rows if mb.packed else torch.arange(kept.shape[0], device=logits.device)).unsqueeze(1)
    resp = logits[b, kept].float()  # [samples, T, V]
    temperature = engine.options.temperature
    if temperature != 1.0:
        resp = resp / temperature
    result = {}
    if "log_probs" in want:
        logp = torch.log_softmax(resp, dim=-1)
        result["log_probs"] = logp.gather(-1, mb.data["_targets"].unsqueeze(-1)).squeeze(-1)
    if "entropy" in want:
        result["entropy"] = entropy_from_logits(resp).float()
    if "sum_pi_squared" in want:
        result["sum_pi_squared"] = sum_pi_squared_from_logits(resp).float()
    return result


def score_slice(engine, mb: MicroBatch, want: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Sequence parallelism: the model on this rank's slice of the tokens; log-probs and entropy
    from the slice's own logits ([b, S/sp, V], never the whole sequence's), placed in the
    [b, T] response layout where this rank holds the position, summed over the group."""
    check_lm_outputs(want)
    model, head, sp = engine.model, engine._head, engine.sp
    local, mine = mb.data["_local"], mb.data["_mine"]
    if head is not None and head.takes(mb.data["_targets"].numel()):
        rows = torch.arange(local.shape[0], device=local.device).unsqueeze(1)
        with head.scoring(rows, local, mb.data["_targets"], want):
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
        return {k: sp.assemble(v * mine) for k, v in head.results(out, want).items()}
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
    logits = (out.logits if hasattr(out, "logits") else out[0]).float()
    if engine.options.temperature != 1.0:
        logits = logits / engine.options.temperature
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1)
    result = {}
    if "log_probs" in want:
        logp = torch.log_softmax(logits, dim=-1)[rows, local, mb.data["_targets"]]
        result["log_probs"] = sp.assemble(logp * mine)
    if "entropy" in want:
        result["entropy"] = sp.assemble(entropy_from_logits(logits)[rows, local] * mine)
    if "sum_pi_squared" in want:
        result["sum_pi_squared"] = sp.assemble(sum_pi_squared_from_logits(logits)[rows, local] * mine)
    return result
