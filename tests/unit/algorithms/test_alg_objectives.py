"""The objectives the trainer hands the engine (verl_hpc.algorithms.objectives): the policy loss
composed by hand from the library's pieces, and micro-batch contributions that add up to the
whole batch's loss and metrics whatever the split (what the engine relies on)."""
import types

import pytest
import torch

from verl_hpc.algorithms import PolicyObjective, ValueObjective, agg_loss, compute_policy_loss, kl_loss, value_loss
from verl_hpc.config.schema import ActorConfig, CriticConfig


def _counts(mask):
    return types.SimpleNamespace(tokens=float(mask.sum()), seqs=float(mask.shape[0]), norm_len=float(mask.shape[1]),
                                 agg_kwargs=lambda: {"global_tokens": float(mask.sum()),
                                                     "global_seqs": float(mask.shape[0]),
                                                     "norm_len": float(mask.shape[1])})


def _batch(b=6, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t).unsqueeze(0) < torch.randint(1, t + 1, (b, 1), generator=g)).float()
    mb = {"response_mask": mask, "old_log_probs": -torch.rand(b, t, generator=g) * mask,
          "ref_log_probs": -torch.rand(b, t, generator=g) * mask, "advantages": torch.randn(b, t, generator=g),
          "values": torch.randn(b, t, generator=g), "returns": torch.randn(b, t, generator=g)}
    out = {"log_probs": -torch.rand(b, t, generator=g) * mask, "entropy": torch.rand(b, t, generator=g),
           "values": torch.randn(b, t, generator=g)}
    return out, mb


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_objective_is_the_composition_of_the_library_pieces(mode):
    cfg = ActorConfig(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    loss_fn = PolicyObjective.from_config(cfg)
    assert loss_fn.outputs == ("log_probs", "entropy")
    out, mb = _batch()
    mask = mb["response_mask"]
    loss, metrics = loss_fn(out, mb, _counts(mask))
    pg, _ = compute_policy_loss("vanilla", mb["old_log_probs"], out["log_probs"], mb["advantages"], mask,
                                loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    ent = agg_loss(out["entropy"], mask, mode)
    kl, _ = kl_loss(out["log_probs"], mb["ref_log_probs"], mask, 0.1, "k3", loss_agg_mode=mode)
    torch.testing.assert_close(loss, pg - 0.01 * ent + kl)
    torch.testing.assert_close(metrics["pg_loss"], pg)  # one micro-batch: its contribution is the whole


def test_micro_batch_contributions_add_up_to_the_whole_batch():
    loss_fn = PolicyObjective.from_config(ActorConfig(entropy_coeff=0.02, use_kl_loss=True))
    out, mb = _batch(b=6)
    counts = _counts(mb["response_mask"])
    whole, whole_m = loss_fn(out, mb, counts)
    parts = [loss_fn({k: v[r] for k, v in out.items()}, {k: v[r] for k, v in mb.items()}, counts)
             for r in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(sum(p[0] for p in parts), whole)
    # the engine reports a token-weighted mean of metrics: for pg_loss that is the whole batch's value
    tokens = [float(mb["response_mask"][r].sum()) for r in (slice(0, 2), slice(2, 6))]
    mean = sum(p[1]["pg_loss"] * n for p, n in zip(parts, tokens)) / sum(tokens)
    torch.testing.assert_close(mean, whole_m["pg_loss"])


def test_kl_loss_without_a_reference_is_a_clear_error():
    out, mb = _batch()
    del mb["ref_log_probs"]
    with pytest.raises(ValueError, match="use_kl_loss=true but the batch has no 'ref_log_probs'"):
        PolicyObjective.from_config(ActorConfig(use_kl_loss=True))(out, mb, _counts(mb["response_mask"]))


def test_value_objective_is_the_clipped_value_loss():
    loss_fn = ValueObjective.from_config(CriticConfig(cliprange_value=0.3))
    out, mb = _batch()
    loss, metrics = loss_fn(out, mb, _counts(mb["response_mask"]))
    want, _ = value_loss(out["values"], mb["values"], mb["returns"], mb["response_mask"], cliprange_value=0.3,
                         loss_agg_mode=CriticConfig().loss_agg_mode)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(metrics["vf_loss"], want)
    assert loss_fn.outputs == ("values",)
