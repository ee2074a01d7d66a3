"""The FSDP engine (verl_hpc/engines/fsdp/) on one gloo rank, in process, against independent
references:

- its log-probs and entropy equal a float64 transformers forward within LOGP_TOL, the bound the
  Megatron engine meets (tests/dist/engines/test_eng_parity.py), at temperature 1 and 0.7;
- one update equals the Megatron engine's within WEIGHT_TOL, on Llama and on a tied Qwen2: the
  actor (a PPO loss with KL and entropy terms), the critic (values before and after, value head
  trained) and PRIME's PRM; the actor's also equals plain transformers in float64 with torch's
  AdamW (tests/update_reference.py);
- its own switches leave the update as it is: a token budget instead of fixed micro-batches, rows
  without gradient left out (with their counts reported), activation checkpointing, no reshard
  after forward, and offload (bitwise);
- a non-finite loss skips the step; the LR schedule is verl_hpc.engines.megatron.optim.schedule_lr.

Adam's eps is 1 (the first step is lr * g / (|g| + 1)) and the gradient is not clipped where the
weights are compared: the comparison then measures gradients, where eps = 1e-8 would make the step
sign(g) and clipping would hide a gradient off by a factor. The layouts of more than one rank
(FSDP 2 and 4, HSDP, ranks with empty micro-batches): tests/dist/engines/test_fsdp_parity.py.
"""
import dataclasses

import pytest
import torch

from update_reference import hf_forward64, hf_update64, max_diff, policy_batch
from verl_hpc.config.schema import ActorConfig, CriticConfig, OptimConfig
from verl_hpc.config.sections.fsdp import FsdpConfig

LOGP_TOL = 2e-5  # fp32 engine vs float64 transformers (the Megatron engine's bound)
WEIGHT_TOL = 1e-5
TEMPERATURE = 0.7
OPTIM = OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0, weight_decay=0.01)
# a PPO actor with every term: KL to the reference and an entropy bonus (the entropy output's grad)
ACTOR = ActorConfig(ppo_mini_batch_size=8, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
FAMILIES = {"llama": dict(family="llama", layers=2), "qwen2": dict(family="qwen2", tied=True, layers=2, seed=1)}
PRM_SECTION = type("PrmSection", (), {"ppo_mini_batch_size": 8, "ppo_epochs": 1})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> a tiny HF folder (llama: untied; qwen2: tied embeddings, q/k/v biases), built
    once per module on first use."""
    from verl_hpc.models.tiny import make_tiny_model

    root, built = tmp_path_factory.mktemp("fsdp_models"), {}

    def get(family):
        if family not in built:
            built[family] = make_tiny_model(root / family, **FAMILIES[family])
        return built[family]

    return get


def _options(folder, engine: str, **changes):
    from verl_hpc.engines.options import default_options

    base = dict(optim=OPTIM, micro_batch_size=3, temperature=TEMPERATURE, total_steps=4)
    return default_options(str(folder), engine=engine, **{**base, **changes})


def _fsdp(folder, **changes):
    from verl_hpc.engines.fsdp import FsdpEngine

    return FsdpEngine(_options(folder, "fsdp", **changes))


def _megatron(folder, **changes):
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)  # idempotent within the one-rank world; torn down by the fixture
    return MegatronEngine(_options(folder, "megatron", **changes))


def _weights(engine):
    return {n: t.clone() for n, t in engine.export_hf_weights()}


def _start(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _moved(weights, folder) -> float:
    start = _start(folder)
    return max(float((weights[n] - start[n]).abs().max()) for n in weights if n in start)


def _actor_update(engine, batch, acfg=ACTOR):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.roles import Actor

    return Actor(engine, acfg).update(batch, PolicyObjective.from_config(acfg))


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("family, temperature", [("llama", 1.0), ("llama", TEMPERATURE), ("qwen2", TEMPERATURE)])
def test_forward_equals_float64_transformers(one_rank_world, models, family, temperature):
    folder, batch = models(family), policy_batch(1)
    out = _fsdp(folder, trainable=False, optim=None, temperature=temperature).forward(batch)
    logp, ent, mask = hf_forward64(folder, batch, temperature)
    if temperature != 1.0:  # the temperature shows in the outputs by far more than the bound
        assert float((hf_forward64(folder, batch)[0] - logp).abs().max()) > 100 * LOGP_TOL
    for key, want in (("log_probs", logp), ("entropy", ent)):
        got = out[key].double()
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= LOGP_TOL, key
        assert bool((got[mask == 0] == 0).all()), f"{key}: padding must be zero"


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_sum_pi_squared_equals_float64_transformers(one_rank_world, models, engine):
    """The optimal token baseline's sum_v pi_v^2 per response token (of logits / temperature), from the
    forward that gives the log-probs, on both engines."""
    from update_reference import _model64
    from verl_hpc.engines.batch import get_response_mask, response_positions

    folder, batch = models("llama"), policy_batch(2)
    make = _fsdp if engine == "fsdp" else _megatron
    out = make(folder).forward(batch, ("log_probs", "entropy", "sum_pi_squared"))
    mask = get_response_mask(batch).double()
    pos = response_positions(batch["prompt_lengths"], mask.shape[1], batch["input_ids"].shape[1])
    with torch.no_grad():
        logits = _model64(folder)(batch["input_ids"]).logits
    rows = logits[torch.arange(len(pos)).unsqueeze(1), pos] / TEMPERATURE
    want = (torch.softmax(rows, -1) ** 2).sum(-1) * mask
    got = out["sum_pi_squared"].double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0.0)
    assert bool((got[mask == 0] == 0).all())
    # the random model is near uniform (sum ~ 1 / vocab), yet tokens differ by far more than the
    # tolerance: a value of the wrong position or temperature would show
    spread = want[mask > 0]
    assert float(spread.max() - spread.min()) > 20 * 1e-4 * float(spread.max())


# ----------------------------------------------------------------------------- FSDP = Megatron


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_actor_update_equals_megatron_and_float64_transformers(one_rank_world, models, family):
    folder, batch = models(family), policy_batch(2)
    fsdp, megatron = _fsdp(folder), _megatron(folder)
    for key, got in fsdp.forward(batch).items():
        assert float((got - megatron.forward(batch)[key]).abs().max()) <= LOGP_TOL, key
    m_fsdp, m_meg = _actor_update(fsdp, batch), _actor_update(megatron, batch)
    w_fsdp, w_meg = _weights(fsdp), _weights(megatron)
    from verl_hpc.algorithms import PolicyObjective

    want, norm = hf_update64(folder, batch, PolicyObjective.from_config(ACTOR), OPTIM, TEMPERATURE)
    assert _moved(w_meg, folder) > 100 * WEIGHT_TOL, "the update must move the weights visibly"
    assert max_diff(w_fsdp, w_meg) <= WEIGHT_TOL
    assert max_diff(w_fsdp, want) <= WEIGHT_TOL
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/tokens"):
        assert m_fsdp[key] == pytest.approx(m_meg[key], rel=1e-6, abs=1e-7), key
    assert m_fsdp["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert m_fsdp["actor/nonfinite_steps"] == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_critic_values_and_update_equal_megatron(one_rank_world, models, family):
    from verl_hpc.algorithms import ValueObjective
    from verl_hpc.engines.roles import Critic

    folder, batch = models(family), policy_batch(3)
    section = CriticConfig(ppo_mini_batch_size=8)
    out = {}
    for name, build in (("fsdp", _fsdp), ("megatron", _megatron)):
        critic = Critic(build(folder, head="value"), section)
        before = critic.values(batch)["values"]
        returns = before + torch.linspace(-1, 1, before.numel()).view_as(before) * batch["response_mask"]
        metrics = critic.update(dict(batch, values=before, returns=returns), ValueObjective.from_config(section))
        out[name] = (before, critic.values(batch)["values"], _weights(critic.engine), metrics)
    (b_f, a_f, w_f, m_f), (b_m, a_m, w_m, m_m) = out["fsdp"], out["megatron"]
    assert "score.weight" in w_f and "lm_head.weight" not in w_f
    assert float((b_f - b_m).abs().max()) <= WEIGHT_TOL
    assert float((a_m - b_m).abs().max()) > 100 * WEIGHT_TOL, "the update must move the values"
    assert float((a_f - a_m).abs().max()) <= WEIGHT_TOL
    assert max_diff(w_f, w_m) <= WEIGHT_TOL
    assert m_f["critic/vf_loss"] == pytest.approx(m_m["critic/vf_loss"], rel=1e-6)
    assert m_f["critic/grad_norm"] == pytest.approx(m_m["critic/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prm_forward_and_update_equal_megatron(one_rank_world, models, family):
    """PRIME's implicit PRM as tests/unit/engines/test_eng_prm.py builds it: a trainable lm head
    whose CE objective reads its log-probs against the reference's."""
    from verl_hpc.algorithms import PrmObjective
    from verl_hpc.engines.roles import ProcessRewardModel

    folder, batch = models(family), policy_batch(4)
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    data = dict(batch, outcome_labels=labels)
    out = {}
    for name, build in (("fsdp", _fsdp), ("megatron", _megatron)):
        prm = ProcessRewardModel(build(folder, temperature=1.0), PRM_SECTION)
        lp = prm.log_probs(batch)["prm_log_probs"]
        metrics = prm.update(data, PrmObjective(beta=0.5, loss="ce"))
        out[name] = (lp, _weights(prm.engine), metrics)
    (lp_f, w_f, m_f), (lp_m, w_m, m_m) = out["fsdp"], out["megatron"]
    assert float((lp_f - lp_m).abs().max()) <= LOGP_TOL
    assert _moved(w_m, folder) > 100 * WEIGHT_TOL
    assert max_diff(w_f, w_m) <= WEIGHT_TOL
    assert m_f["prm/ce_loss"] == pytest.approx(m_m["prm/ce_loss"], rel=1e-6)


# ----------------------------------------------------------------------------- the engine's switches


def test_token_budget_gives_the_update_of_fixed_micro_batches(one_rank_world, models):
    folder, batch = models("llama"), policy_batch(5)
    fixed, budget = _fsdp(folder, micro_batch_size=2), _fsdp(folder, max_tokens_per_microbatch=24)
    m_fixed, m_budget = _actor_update(fixed, batch), _actor_update(budget, batch)
    assert m_fixed["actor/num_microbatches"] == 4.0 != m_budget["actor/num_microbatches"]
    assert _moved(_weights(fixed), folder) > 100 * WEIGHT_TOL
    assert max_diff(_weights(fixed), _weights(budget)) <= WEIGHT_TOL
    assert m_fixed["actor/loss"] == pytest.approx(m_budget["actor/loss"], rel=1e-6)


def test_rows_without_gradient_are_left_out_with_the_same_update(one_rank_world, models):
    """A policy loss with no KL or entropy term names the rows whose advantages are all 0
    (PolicyObjective.rows_without_gradient): the engine leaves them out and reports them. One row
    per micro-batch: a left-out row only ever added exact zeros, so the weights are bitwise the
    full update's; then an update where every row is such a row (the shortest still runs, the
    step runs: Adam's moments still move the weights)."""
    folder = models("llama")
    first, second = policy_batch(6, zero_rows=(0, 3, 4, 6)), policy_batch(6, zero_rows=range(8))
    base = dict(ppo_mini_batch_size=8, use_kl_loss=False, entropy_coeff=0.0)
    runs = {}
    for skip in (False, True):
        eng = _fsdp(folder, micro_batch_size=1)
        acfg = ActorConfig(skip_zero_advantage_rows=skip, **base)
        m1, w1 = _actor_update(eng, first, acfg), _weights(eng)
        m2, w2 = _actor_update(eng, second, acfg), _weights(eng)
        runs[skip] = (m1, w1, m2, w2)
    (f1, fw1, f2, fw2), (s1, sw1, s2, sw2) = runs[False], runs[True]
    assert max_diff(fw1, fw2) > 100 * WEIGHT_TOL, "the all-zero update moved nothing"
    assert all(torch.equal(sw1[n], fw1[n]) for n in fw1) and all(torch.equal(sw2[n], fw2[n]) for n in fw2)
    mask = first["response_mask"]
    assert s1["actor/zero_adv_skipped_share"] == 4 / 8 and f1["actor/zero_adv_skipped_share"] == 0.0
    assert s1["actor/zero_adv_skipped_tokens_share"] == pytest.approx(float(mask[[0, 3, 4, 6]].sum() / mask.sum()))
    assert s1["actor/num_microbatches"] == 4.0 and f1["actor/num_microbatches"] == 8.0
    assert s2["actor/zero_adv_skipped_share"] == 7 / 8 and s2["actor/num_microbatches"] == 1.0
    assert s1["actor/pg_loss"] == pytest.approx(f1["actor/pg_loss"], rel=1e-6)


def test_a_nonfinite_loss_skips_the_step(one_rank_world, models):
    from verl_hpc.algorithms import PolicyObjective

    folder, batch = models("llama"), policy_batch(7)
    eng, loss = _fsdp(folder), PolicyObjective.from_config(ACTOR)
    before = _weights(eng)
    bad = dict(batch, advantages=batch["advantages"].clone())
    bad["advantages"][1, 0] = float("nan")
    metrics = eng.train_step(bad, loss, loss.outputs)
    assert metrics["nonfinite"] == 1.0 and eng.steps_applied == 0
    assert all(torch.equal(t, before[n]) for n, t in _weights(eng).items())
    assert not any(eng.optimizer.state.values()), "Adam's moments must not be touched"
    metrics = eng.train_step(batch, loss, loss.outputs)  # and it still trains afterwards
    assert metrics["nonfinite"] == 0.0 and eng.steps_applied == 1
    assert max_diff(_weights(eng), before) > 100 * WEIGHT_TOL


def _watch_first_layer(eng):
    """{"runs": the first decoder layer's forward computations, "gathered": per forward, whether
    its weights stayed gathered after it (FSDP2 swaps a unit's sharded DTensor parameters for the
    full ones while gathered)}."""
    layer, seen = eng.model.model.layers[0], {"runs": 0, "gathered": []}
    inner = layer.forward

    def forward(*args, **kwargs):  # inside FSDP's hooks and the recompute's function
        seen["runs"] += 1
        return inner(*args, **kwargs)

    layer.forward = forward
    layer.register_forward_hook(lambda m, i, o: seen["gathered"].append(
        not any(hasattr(p, "to_local") for p in m.parameters())))
    return seen


@pytest.mark.parametrize("change", ["activation_checkpointing", "no_reshard_after_forward"])
def test_fsdp_switches_give_the_update_of_the_defaults(one_rank_world, models, change):
    folder, batch = models("llama"), policy_batch(8)
    fsdp = (FsdpConfig(activation_checkpointing=True) if change == "activation_checkpointing"
            else FsdpConfig(reshard_after_forward=False))
    default, switched = _fsdp(folder), _fsdp(folder, fsdp=fsdp)
    seen = {"default": _watch_first_layer(default), "switched": _watch_first_layer(switched)}
    m_def, m_sw = _actor_update(default, batch), _actor_update(switched, batch)
    assert max_diff(_weights(default), _weights(switched)) <= WEIGHT_TOL
    assert m_def["actor/loss"] == pytest.approx(m_sw["actor/loss"], rel=1e-6)
    assert m_def["actor/grad_norm"] == pytest.approx(m_sw["actor/grad_norm"], rel=1e-5)
    gathered = seen["switched"]["gathered"]
    if change == "activation_checkpointing":  # the layers recompute in the backward
        assert switched.model.model.gradient_checkpointing
        assert seen["switched"]["runs"] == 2 * seen["default"]["runs"] == 6
        assert not any(gathered)
    else:
        assert gathered and all(gathered) and not any(seen["default"]["gathered"])
        # a no-grad forward reshards too: the state is of the sharded parameters and the optimizer's
        out = switched.forward(batch)
        assert sorted(t.name for t in switched.state().tensors) == sorted(t.name for t in default.state().tensors)
        assert float((out["log_probs"] - default.forward(batch)["log_probs"]).abs().max()) <= WEIGHT_TOL


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_lr_schedule_is_megatrons(one_rank_world, models, style):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.engines.megatron.optim import schedule_lr

    optim = dataclasses.replace(OPTIM, lr=0.1, min_lr=0.01, warmup_steps=2, lr_decay_style=style)
    eng = _fsdp(models("llama"), optim=optim, total_steps=6)
    # the schedule itself (scheduler_step advances it only after an applied optimizer step:
    # tests/unit/engines/test_eng_fp16.py)
    lrs = [eng.lr] + [eng.scheduler.step(1) or eng.lr for _ in range(8)]
    want = [schedule_lr(optim, 6, step) for step in range(9)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert lrs[0] == 0.0 and lrs[2] == 0.1 and lrs[-1] == 0.01 and len(set(lrs)) > 5
    eng.scheduler.load_state_dict({"num_steps": 3})  # a resumed schedule; the step uses its LR
    loss = PolicyObjective.from_config(ACTOR)
    metrics = eng.train_step(policy_batch(9), loss, loss.outputs)
    assert metrics["lr"] == pytest.approx(want[3], rel=1e-12)
    assert {g["lr"] for g in eng.optimizer.param_groups} == {metrics["lr"]}


def test_offload_gives_bitwise_the_same_results(one_rank_world, models):
    """param_offload and optimizer_offload: the states leave the device between phases and come
    back bit for bit; two updates (the second with the Adam moments that were offloaded)."""
    folder, batches = models("llama"), (policy_batch(10), policy_batch(11))
    runs = {}
    for off in (False, True):
        eng = _fsdp(folder, param_offload=off, optimizer_offload=off)
        res = [eng.forward(batches[0])]
        for b in batches:
            res.append(_actor_update(eng, b))
        res += [eng.forward(batches[1]), _weights(eng)]
        res.append({t.name: t.local.clone() for t in eng.state().tensors})
        runs[off] = (res, eng.offloader.device_bytes())
    (plain, _), (offloaded, idle) = runs[False], runs[True]
    assert idle == {"params": 0, "grads": 0, "optimizer": 0}, "offloaded while idle"
    assert plain[1] == offloaded[1] and plain[2] == offloaded[2]  # metrics, exactly
    for a, b in ((plain[0], offloaded[0]), (plain[3], offloaded[3]), (plain[4], offloaded[4]), (plain[5], offloaded[5])):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
