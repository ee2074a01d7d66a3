"""PRIME's implicit PRM as an engine role on one gloo rank: it starts equal to the reference (every
process reward 0 up to float summation order), its CE and pairwise updates move the implicit scores toward the outcome labels,
and it lives apart from the actor (training one leaves the other's outputs bitwise alone). The
TP/PP layouts: tests/dist/engines/test_eng_prm_parity.py."""
import dataclasses

import pytest
import torch

from verl_hpc.algorithms import PrmObjective
from verl_hpc.algorithms.prime import implicit_scores, implicit_token_rewards, pairwise_partners


def _batch(seed=0, n=8):
    from verl_hpc.engines.batch import pack_sequences

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 480, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    resps = [torch.randint(5, 480, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    from verl_hpc.engines.batch import get_response_mask

    batch = pack_sequences(prompts, resps)
    return dict(batch, response_mask=get_response_mask(batch))


@pytest.fixture
def engines(one_rank_world, tmp_path):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import MegatronEngine, ProcessRewardModel, default_options
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    init_model_parallel(1, 1)
    optim = OptimConfig(lr=1e-2, eps=1e-8, weight_decay=0.0)
    opts = default_options(model_path=str(model), optim=optim, micro_batch_size=2)
    ref = MegatronEngine(dataclasses.replace(opts, trainable=False, optim=None))
    role_cfg = type("PrmSection", (), {"ppo_mini_batch_size": 4, "ppo_epochs": 1})
    prm = ProcessRewardModel(MegatronEngine(opts), role_cfg, n=2)
    actor = MegatronEngine(opts)
    return ref, prm, actor


def _scores(prm, ref_lp, batch, beta=0.5):
    lp = prm.log_probs(batch)["prm_log_probs"]
    return implicit_scores(implicit_token_rewards(lp, ref_lp, batch["response_mask"], beta), batch["response_mask"])


@pytest.mark.numerics
@pytest.mark.parametrize("loss", ["ce", "pairwise"])
def test_prm_starts_at_the_reference_and_learns_the_labels(engines, loss):
    ref, prm, actor = engines
    batch = _batch()
    ref_lp = ref.forward(batch, ("log_probs",))["log_probs"]
    labels = torch.tensor([1.0, 0.0] * 4)
    groups = torch.arange(4).repeat_interleave(2)
    start = _scores(prm, ref_lp, batch)
    assert start.abs().max() < 1e-5  # the reference's weights: r_t = 0 up to summation order
    data = dict(batch, ref_log_probs=ref_lp, outcome_labels=labels)
    data["prm_partners"] = pairwise_partners(start, labels, groups)
    metrics = {}
    for _ in range(5):
        metrics = prm.update(data, PrmObjective(beta=0.5, loss=loss))
    after = _scores(prm, ref_lp, batch)
    assert metrics["prm/nonfinite_steps"] == 0 and f"prm/{loss}_loss" in metrics
    assert (after[labels == 1] > 0).all() and (after[labels == 0] < 0).all(), after


def test_prm_and_actor_train_apart(engines):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config import load_config

    ref, prm, actor = engines
    batch = _batch(seed=1)
    before = prm.log_probs(batch)["prm_log_probs"]
    ref_before = ref.forward(batch, ("log_probs",))["log_probs"]
    policy = PolicyObjective.from_config(load_config(None).actor)
    old = actor.forward(batch, ("log_probs",))["log_probs"]
    adv = torch.randn(old.shape) * batch["response_mask"]
    for _ in range(3):
        actor.train_step(dict(batch, old_log_probs=old, advantages=adv), policy, ("log_probs",))
    assert not torch.equal(actor.forward(batch, ("log_probs",))["log_probs"], old)  # the actor moved
    assert torch.equal(prm.log_probs(batch)["prm_log_probs"], before)  # the PRM did not
    assert torch.equal(ref.forward(batch, ("log_probs",))["log_probs"], ref_before)
    data = dict(batch, ref_log_probs=ref_before, outcome_labels=torch.ones(8))
    prm.update(data, PrmObjective(beta=0.5, loss="ce"))
    assert not torch.equal(prm.log_probs(batch)["prm_log_probs"], before)
    actor_now = actor.forward(batch, ("log_probs",))["log_probs"]
    prm.update(data, PrmObjective(beta=0.5, loss="ce"))
    assert torch.equal(actor.forward(batch, ("log_probs",))["log_probs"], actor_now)


def test_single_rank_prm_update_equals_transformers(one_rank_world, tmp_path):
    """The one-rank PRM's CE update lands where the hand-written loss in transformers does (the
    TP2 / PP2 engines are held to the same reference in tests/dist/engines/test_eng_parity.py)."""
    from transformers import AutoModelForCausalLM

    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.batch import response_positions, response_tokens
    from verl_hpc.engines.megatron import MegatronEngine, ProcessRewardModel, default_options
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    init_model_parallel(1, 1)
    optim = dict(lr=0.5, eps=1.0, clip_grad=1.0, weight_decay=0.0)  # SGD-like first step: compares gradients
    batch = _batch(seed=3)
    mask = batch["response_mask"]
    ref_lp = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)) * mask
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    role_cfg = type("PrmSection", (), {"ppo_mini_batch_size": 8, "ppo_epochs": 1})
    prm = ProcessRewardModel(MegatronEngine(default_options(model_path=str(model), optim=OptimConfig(**optim),
                                                            micro_batch_size=3)), role_cfg)
    prm.update(dict(batch, ref_log_probs=ref_lp, outcome_labels=labels), PrmObjective(beta=0.5, loss="ce"))
    got = {n: t.clone() for n, t in prm.engine.export_hf_weights()}

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    start = {n: p.detach().clone() for n, p in hf.state_dict().items()}
    logits = hf(batch["input_ids"]).logits
    pos = response_positions(batch["prompt_lengths"], mask.shape[1], batch["input_ids"].shape[1])
    rows = torch.log_softmax(logits[torch.arange(len(pos)).unsqueeze(1), pos], dim=-1)
    tok = response_tokens(batch["input_ids"], batch["prompt_lengths"], mask.shape[1])
    logp = rows.gather(-1, tok.unsqueeze(-1)).squeeze(-1) * mask
    score = 0.5 * ((logp - ref_lp) * mask).sum(-1)
    loss = (labels * torch.nn.functional.softplus(-score) + (1 - labels) * torch.nn.functional.softplus(score)).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), optim["clip_grad"])
    torch.optim.AdamW(hf.parameters(), lr=optim["lr"], eps=optim["eps"], weight_decay=0.0).step()
    want = {n: p.detach() for n, p in hf.state_dict().items() if n in got}
    assert sorted(want) == sorted(got)
    assert max(float((want[n] - start[n]).abs().max()) for n in got) > 1e-3  # the update moved the weights
    assert max(float((got[n] - want[n]).abs().max()) for n in got) <= 1e-5
