"""Prompt sharing on the FSDP engine (engines/fsdp/sharing.py): packed micro-batches (one row per
prompt, a dense 4D mask through transformers' SDPA) give the log-probs, entropy and update of one
sequence per row, and the cost model keeps rows unpacked where the mask would cost more."""
import dataclasses

import pytest
import torch

from engine_states import grpo_batch
from verl_hpc.engines.batch import get_response_mask, pack_sequences


def _loss(outs, mb, counts):
    m = mb["response_mask"]
    return -(outs["log_probs"] * mb["advantages"] * m).sum() / counts.tokens, {}


@pytest.fixture
def engines(one_rank_world, tmp_path):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options
    from verl_hpc.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "qwen2", "qwen2", layers=2)
    o = default_options(str(path), engine="fsdp", optim=OptimConfig(lr=1e-2), micro_batch_size=12)
    return (FsdpEngine(dataclasses.replace(o, share_prompts="on")),
            FsdpEngine(dataclasses.replace(o, share_prompts="off")))


def test_packed_rows_give_the_plain_layouts_outputs_and_update(engines):
    packed, plain = engines
    batch = grpo_batch()
    a, b = packed.forward(batch), plain.forward(batch)
    for key in ("log_probs", "entropy"):
        assert (a[key] - b[key]).abs().max() < 2e-5, key
    ma, mb = packed.train_step(batch, _loss), plain.train_step(batch, _loss)
    assert ma["packed_microbatches"] == 1.0 and mb["packed_microbatches"] == 0.0
    assert abs(ma["loss"] - mb["loss"]) < 1e-5 and abs(ma["grad_norm"] - mb["grad_norm"]) < 1e-4
    # the gradients (Adam's first step moves every weight by about lr whatever the gradient's size,
    # so the weights after it would hide a gradient error and magnify rounding near 0)
    ga = {n: p.grad.full_tensor() for n, p in packed.model.named_parameters()}
    gb = {n: p.grad.full_tensor() for n, p in plain.model.named_parameters()}
    assert max((ga[k] - gb[k]).abs().max().item() for k in ga) < 1e-5
    assert max(g.abs().max().item() for g in gb.values()) > 1e-3  # and they are not all ~0


def test_auto_packs_only_where_the_dense_mask_pays(tmp_path):
    from types import SimpleNamespace

    from verl_hpc.engines.fsdp.sharing import DenseMaskCost
    from verl_hpc.engines.prefix import PromptSharing

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=16, num_key_value_heads=2,
                          intermediate_size=128)
    auto = PromptSharing(DenseMaskCost.for_config(cfg))
    many = grpo_batch(groups=1, n=8, prompt=20)  # 8 responses to a long prompt: the prompt dominates
    assert auto(many, int(many["response_mask"].shape[1])) is not None
    single = grpo_batch(groups=4, n=1)  # no prompt repeated: nothing to share
    assert auto(single, int(single["response_mask"].shape[1])) is None
    # long responses to a short prompt: the dense mask's S^2 costs more than the prompt copies save
    long = pack_sequences([[7, 8]] * 2, [list(range(5, 400)), list(range(5, 390))])
    assert auto(dict(long, response_mask=get_response_mask(long)), 395) is None
