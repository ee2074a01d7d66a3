"""Dropout off in the policy's forwards (model.disable_dropout, verl_hpc/models/dropout.py): folders
whose config.json keeps a pretraining dropout of 0.1 (GPT-2's resid/embd/attn_pdrop, Starcoder2's
residual/embedding/attention_dropout, GPT-NeoX's hidden/attention_dropout) train as the float64
transformers reference in eval mode (no dropout) within 1e-5. With model.disable_dropout=false the
update is that of a randomly thinned network (shown: the same check then fails), which is what
85ec11b trained by default."""
import dataclasses

import pytest
import torch

from arch_matrix import make_arch
from update_reference import hf_update64, max_diff, policy_batch

TOL = 1e-5


def _loss(outs, mb, counts):
    return -(outs["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / counts.tokens, {}


@pytest.mark.parametrize("arch", ["gpt2", "starcoder2", "gpt_neox"])
def test_an_update_of_a_folder_with_dropout_equals_the_reference_without_it(arch, one_rank_world, tmp_path):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    path = make_arch(tmp_path / arch, arch, dropout=0.1)
    batch, optim = policy_batch(3, n=6), OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0)
    want, _ = hf_update64(path, batch, _loss, optim)
    o = default_options(str(path), engine="fsdp", optim=optim, micro_batch_size=12)
    assert o.disable_dropout  # the default
    diffs = {}
    for disable in (True, False):
        engine = FsdpEngine(dataclasses.replace(o, disable_dropout=disable))
        cfg = engine.model.config
        rates = [m.p for m in engine.model.modules() if isinstance(m, torch.nn.Dropout)]
        rates += [v for k, v in vars(cfg).items() if k.endswith(("dropout", "pdrop")) and k != "summary_first_dropout"]
        assert len(rates) >= 2 and all((p == 0.0) == disable for p in rates), rates
        engine.train_step(batch, _loss)
        diffs[disable] = max_diff({n: p.detach().full_tensor() for n, p in engine.model.named_parameters()}, want)
    assert diffs[True] <= TOL
    assert diffs[False] > 100 * TOL  # the check sees dropout where it is left on


def test_every_dropout_rate_of_a_config_and_its_sub_configs_is_zeroed():
    import transformers as tf

    from verl_hpc.models.dropout import zero_config_dropout

    gpt2 = tf.GPT2Config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.2, summary_first_dropout=0.0)
    assert sorted(zero_config_dropout(gpt2)) == ["attn_pdrop", "embd_pdrop", "resid_pdrop"]
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop) == (0.0, 0.0, 0.0)
    vlm = tf.Qwen2_5_VLConfig(text_config=dict(attention_dropout=0.1))
    assert zero_config_dropout(vlm) == ["text_config.attention_dropout"]
    assert vlm.text_config.attention_dropout == 0.0


def test_keeping_dropout_on_the_megatron_engine_is_refused_before_the_queue():
    from verl_hpc.config import load_config

    job = load_config(None, ["model.disable_dropout=false", "parallel.engine=megatron"])
    said = [p for p in job.model.check(job) if "dropout" in p]
    assert len(said) == 1 and "model.disable_dropout" in said[0] and "parallel.engine=fsdp" in said[0]
    job = load_config(None, ["model.disable_dropout=false", "parallel.engine=fsdp"])
    assert not [p for p in job.model.check(job) if "dropout" in p]
