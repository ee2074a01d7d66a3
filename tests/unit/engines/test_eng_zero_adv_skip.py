"""Rows whose advantages are all 0 left out of the actor update (actor.skip_zero_advantage_rows).

The update with the skip must equal the full update: the policy losses on their own (every loss
the config lets skip leaves the other rows' loss and gradient as they are, the skipped rows' are
exactly 0), and the real Megatron engine on one gloo rank: GRPO batches with uniform groups, one
mini-batch and then a whole update where every group is uniform, bitwise the same weights as the
full update when each row is its own micro-batch (a skipped row only ever added exact zeros to the
gradient sums), within float tolerance when the rows share micro-batches differently.
"""
import pytest
import torch

from verl_hpc.config.schema import ActorConfig, OptimConfig

N = 4  # responses per prompt (the GRPO group)


# ----------------------------------------------------------------------------- the rule


def test_zero_advantage_rows_are_rows_with_tokens_all_zero():
    from verl_hpc.algorithms.masked import zero_advantage_rows

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([[0.0, -0.0, 5.0],  # nonzero on padding only: still a zero row
                        [0.0, 0.0, 1e-30],  # one tiny nonzero token: it has a gradient
                        [0.0, 0.0, 0.0],  # no valid token: the loss must still see (and refuse) it
                        [float("nan"), 0.0, 0.0],  # NaN is not 0: the update must see it
                        [0.0, 0.0, 0.0]])
    assert zero_advantage_rows(adv, mask).tolist() == [True, False, False, False, True]


@pytest.mark.parametrize("change, blocked_by", [
    (dict(skip_zero_advantage_rows=False), "actor.skip_zero_advantage_rows"),
    (dict(use_kl_loss=True), "actor.use_kl_loss"),
    (dict(entropy_coeff=0.01), "actor.entropy_coeff"),
    (dict(policy_loss="clip_cov"), "actor.policy_loss = clip_cov"),
    (dict(policy_loss="kl_cov"), "actor.policy_loss = kl_cov"),
    (dict(policy_loss="dro"), "actor.policy_loss = dro"),
])
def test_kl_entropy_or_row_coupling_losses_skip_nothing(change, blocked_by):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.sections.roles import zero_advantage_skip_blockers

    batch = {"advantages": torch.tensor([[0.0, 0.0], [1.0, 0.0]]), "response_mask": torch.ones(2, 2)}
    assert PolicyObjective.from_config(ActorConfig()).rows_without_gradient(batch).tolist() == [True, False]
    cfg = ActorConfig(**change)
    assert PolicyObjective.from_config(cfg).rows_without_gradient(batch) is None
    (why,) = zero_advantage_skip_blockers(cfg)
    assert blocked_by in why


def _loss_inputs(g):
    """8 rows of random log-probs around old ones; rows 1, 4, 5 and 7 have all-zero advantages."""
    rows, width = 8, 6
    lengths = torch.tensor([6, 2, 5, 3, 6, 1, 4, 2])
    mask = (torch.arange(width) < lengths.unsqueeze(1)).float()
    old = -torch.rand(rows, width, generator=g) * 3 * mask
    new = (old + 0.3 * torch.randn(rows, width, generator=g)) * mask
    adv = torch.randn(rows, 1, generator=g).expand(rows, width) * mask
    zero = torch.tensor([1, 4, 5, 7])
    adv = adv.clone()
    adv[zero] = 0.0
    weights = (0.5 + torch.rand(rows, width, generator=g)) * mask  # mismatch correction: still 0 x w
    rollout = (old + 0.8 * torch.randn(rows, width, generator=g)) * mask  # icepop's band cuts some tokens
    from verl_hpc.algorithms.m2po import m2po_keep
    keep, _ = m2po_keep(old, rollout, mask, ActorConfig().m2_threshold)  # m2po: the whole batch's mask, made before any skip
    return new, {"old_log_probs": old, "advantages": adv, "response_mask": mask, "rollout_is_weights": weights,
                 "rollout_log_probs": rollout, "m2po_keep": keep}, zero


@pytest.mark.parametrize("mode", ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"))
def test_every_loss_that_may_skip_gives_the_same_loss_and_gradients_without_those_rows(mode):
    """For each policy loss the rule lets skip (config.recipes.ROW_LOCAL_POLICY_LOSSES): the loss
    of the other rows with the whole batch's counts equals the whole batch's loss, their gradients
    are the same, and the skipped rows' gradients are exactly 0. The registry's other losses are
    exactly those the rule names as coupling rows."""
    from verl_hpc.algorithms import POLICY_LOSS_REGISTRY, PolicyObjective
    from verl_hpc.config.recipes import ROW_LOCAL_POLICY_LOSSES
    from verl_hpc.engines.base import GlobalCounts

    assert set(POLICY_LOSS_REGISTRY.names()) - set(ROW_LOCAL_POLICY_LOSSES) == {"clip_cov", "kl_cov", "dro"}
    g = torch.Generator().manual_seed(3)
    new, mb, zero = _loss_inputs(g)
    counts = GlobalCounts(tokens=float(mb["response_mask"].sum()), seqs=8.0, norm_len=6.0)
    keep = torch.tensor([i for i in range(8) if i not in zero.tolist()])
    for name in ROW_LOCAL_POLICY_LOSSES:
        loss_fn = PolicyObjective.from_config(ActorConfig(policy_loss=name, loss_agg_mode=mode))
        assert loss_fn.rows_without_gradient(mb).nonzero().flatten().tolist() == zero.tolist()
        full_in = new.clone().requires_grad_(True)
        full, _ = loss_fn({"log_probs": full_in}, mb, counts)
        full.backward()
        part_in = new[keep].clone().requires_grad_(True)
        part, _ = loss_fn({"log_probs": part_in}, {k: v[keep] for k, v in mb.items()}, counts)
        part.backward()
        assert torch.count_nonzero(full_in.grad[keep]) > 0, name  # the comparison shows something
        assert torch.equal(full_in.grad[zero], torch.zeros_like(full_in.grad[zero])), name
        torch.testing.assert_close(part, full, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(part_in.grad, full_in.grad[keep], rtol=1e-6, atol=1e-8, msg=name)


# ----------------------------------------------------------------------------- the engine


def _grpo_batch(g, vocab: int, uniform):
    """len(uniform) prompts x N responses, GRPO advantages; a group in `uniform` got one reward
    for every sample (so advantages 0), the others mixed rewards."""
    from verl_hpc.algorithms import compute_advantages
    from verl_hpc.engines.batch import length_mask, pack_sequences

    prompts, responses, rewards = [], [], []
    for same in uniform:
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for k in range(N):
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (int(torch.randint(1, 6, (1,), generator=g)),),
                                           generator=g).tolist())
            rewards.append(1.0 if same else float(k % 2))
    b = pack_sequences(prompts, responses)
    mask = length_mask(b["response_lengths"], int(b["response_lengths"].max())).float()
    scores = torch.zeros_like(mask)
    scores[torch.arange(len(rewards)), b["response_lengths"] - 1] = torch.tensor(rewards)
    group_ids = torch.arange(len(uniform)).repeat_interleave(N)
    b["response_mask"] = mask
    b["advantages"], _ = compute_advantages("grpo", scores, mask, group_ids=group_ids, norm_adv_by_std=True)
    return b


def _run(model, acfg, batches, micro: int):
    """Actor updates on `batches` (pi_old from a separate forward, so the second mini-batch is
    off-policy); the weights after each update and the metrics."""
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.megatron import Actor, MegatronEngine, default_options

    torch.manual_seed(0)
    # Adam's eps = 1: lr * g / (|g| + 1) compares gradients (eps=1e-8 would make it sign(g)); no
    # clipping, which would hide a gradient off by a factor (wrong counts)
    eng = MegatronEngine(default_options(model_path=str(model), optim=OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0),
                                         micro_batch_size=micro, total_steps=len(batches)))
    actor, loss = Actor(eng, acfg, n=N), PolicyObjective.from_config(acfg)
    weights, metrics = [], []
    for b in batches:
        b = dict(b, old_log_probs=actor.log_probs(b)["old_log_probs"])
        metrics.append(actor.update(b, loss))
        weights.append({n: t.clone() for n, t in eng.export_hf_weights()})
    return weights, metrics


@pytest.mark.parametrize("mode, micro, exact", [("token-mean", 1, True), ("seq-mean-token-mean", 1, True),
                                                ("seq-mean-token-mean", 3, False)])
def test_skipping_gives_the_weights_of_the_full_update(one_rank_world, tmp_path, mode, micro, exact):
    """Update 1: groups 0, 2, 3 of 4 uniform, so the second mini-batch (groups 2, 3) has nothing
    to learn; update 2: every group uniform. Its zero-gradient optimizer steps still move the
    weights (Adam's moments), and must move them alike."""
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    init_model_parallel(1, 1)
    g = torch.Generator().manual_seed(1)
    batches = [_grpo_batch(g, 250, (True, False, True, True)), _grpo_batch(g, 250, (True,) * 4)]
    base = dict(ppo_mini_batch_size=2, loss_agg_mode=mode, micro_batch_size=micro)
    full_w, full_m = _run(model, ActorConfig(skip_zero_advantage_rows=False, **base), batches, micro)
    skip_w, skip_m = _run(model, ActorConfig(**base), batches, micro)

    assert any(not torch.equal(full_w[0][n], full_w[1][n]) for n in full_w[0]), \
        "the all-uniform update moved nothing: it would not show a dropped optimizer step"
    for step in (0, 1):
        for name in full_w[step]:
            if exact:
                assert torch.equal(skip_w[step][name], full_w[step][name]), (step, name)
            else:
                torch.testing.assert_close(skip_w[step][name], full_w[step][name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(skip_m[step]["actor/pg_loss"], full_m[step]["actor/pg_loss"],
                                   rtol=1e-5, atol=1e-7)
        assert skip_m[step]["actor/nonfinite_steps"] == 0.0
        assert full_m[step]["actor/zero_adv_skipped_share"] == 0.0
        assert full_m[step]["actor/zero_adv_skipped_tokens_share"] == 0.0

    # the shares: update 1 skips group 0 and all of groups 2, 3 but the shortest row, which runs
    # so that the mini-batch's step has its loss and metrics; update 2 the same in both mini-batches
    for step, b in enumerate(batches):
        lengths = b["prompt_lengths"] + b["response_lengths"]
        skipped = b["advantages"].abs().sum(-1) == 0
        for half in (slice(0, 8), slice(8, 16)):
            if bool(skipped[half].all()):
                skipped[half.start + int(lengths[half].argmin())] = False
        tokens = b["response_mask"].sum(-1)
        assert skip_m[step]["actor/zero_adv_skipped_share"] == float(skipped.sum()) / 16
        assert skip_m[step]["actor/zero_adv_skipped_tokens_share"] == pytest.approx(
            float(tokens[skipped].sum() / tokens.sum()))
    assert skip_m[0]["actor/zero_adv_skipped_share"] == 11 / 16 and skip_m[1]["actor/zero_adv_skipped_share"] == 14 / 16
    assert skip_m[1]["actor/num_microbatches"] == 1.0 < full_m[1]["actor/num_microbatches"]


def test_an_entropy_bonus_runs_every_row(one_rank_world, tmp_path):
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    init_model_parallel(1, 1)
    b = _grpo_batch(torch.Generator().manual_seed(1), 250, (True, False, True, True))
    _, (m,) = _run(model, ActorConfig(ppo_mini_batch_size=2, micro_batch_size=1, entropy_coeff=0.01), [b], 1)
    assert m["actor/zero_adv_skipped_share"] == 0.0
    assert m["actor/num_microbatches"] == 8.0  # 16 rows in 2 mini-batches, one row per micro-batch
