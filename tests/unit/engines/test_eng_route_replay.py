"""MoE routing replay (model.moe_routing_replay; docs/moe.md): HF generate records each token's
experts, the Megatron engine's forwards replay them.

The rollout/training mismatch that replay removes is made by construction, not left to rounding:
the rollout's routers send one token in eight (in each layer) to its third-best expert instead of
its second (`misrouted`), as an engine whose arithmetic flips a near-tie would, and the rollout's
log-probs and recorded routes are those of that routing. The tiny Qwen3-MoE's routers keep their
wide margins (weights N(0, 1)), so Megatron's own routing is the natural one on any CPU, any BLAS
code path and any thread count: without replay it differs from the rollout's on those tokens, with
replay it takes them.
"""
import dataclasses
import pickle

import pytest
import torch

from verl_hpc.models.moe_routes import MISSING, fit_width, pad_routes

pytestmark = pytest.mark.numerics  # make test-portable


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("replay") / "m", "qwen3_moe", seed=21))


def misrouted(model):
    """Hooks that make each router of the HF model send some tokens' second slot to their
    third-best expert, the gate weights taken from the router's own probabilities at the chosen
    experts as transformers does (softmax, top-k renormalised): what Megatron's replay computes for
    those routes. Which tokens: those whose router input has its first three features > 0 (one in
    eight), a function of the token's hidden state alone, so that a prompt token routes alike in
    every sample of its prompt (the shared prefill; a packed row routes it once), and no rule a
    rounding difference could tip but at an exact zero. Put before the route recorder's hooks
    (prepend), so that what is recorded is what the experts ran."""
    def hook(router, args, output):
        logits, _, chosen = output
        probs = torch.softmax(logits.float(), dim=-1)
        rows = (args[0].reshape(chosen.shape[0], -1)[:, :3] > 0).all(-1)
        chosen = chosen.clone()
        free = probs.scatter(1, chosen, -1.0)  # the experts not chosen, best first
        chosen[rows, 1] = free[rows].argmax(-1)
        weights = probs.gather(1, chosen)
        if router.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook, prepend=True)


@pytest.fixture(scope="module")
def rollout(moe_model):
    """A sampled fp32 rollout with its routes, as the trainer's batch (batching.assemble's layout)."""
    from verl_hpc.engines.batch import pack_sequences
    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec

    engine = HFRollout(moe_model, **default_engine_args("hf", max_prompt_length=64, max_response_length=16),
                       record_routes=True)
    misrouted(engine.model)
    prompts = [[5 + i, 6, 7 + i, 9, 10 + 2 * i] for i in range(8)]
    res = engine.generate(prompts, default_spec(temperature=1.0, max_tokens=16, n=2, seed=3))
    engine.close()
    batch = pack_sequences([res.prompts[i] for i in res.prompt_index], res.response_ids, 0)
    width = int(batch["response_lengths"].max())
    logp, mask = torch.zeros(len(res), width), torch.zeros(len(res), width)
    for i, lp in enumerate(res.logprobs):
        logp[i, :len(lp)], mask[i, :len(lp)] = torch.tensor(lp), 1.0
    batch["response_mask"] = mask
    # every fed token has a route: the prompt's and the response's but the last
    assert [r.shape[0] for r in res.routes] == [len(res.sequence(i)) - 1 for i in range(len(res))]
    return batch, pad_routes(res.routes, batch["input_ids"].shape[1]), logp, mask


def _engine(path, mode, **changes):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import MegatronEngine, default_options
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    o = default_options(model_path=path, **{**dict(optim=OptimConfig(lr=1e-3), micro_batch_size=3, total_steps=1,
                                                   temperature=1.0), **changes})
    return MegatronEngine(dataclasses.replace(o, moe_options=dict(o.moe_options, routing_replay=mode)))


@pytest.mark.parametrize("share", ["off", "on"], ids=["one_row_per_sample", "prompts_packed"])
def test_replayed_training_logprobs_equal_the_rollouts(one_rank_world, moe_model, rollout, share):
    """share on: a prompt's samples packed into one model row (engines/prefix.py), routes with them."""
    batch, routes, logp, mask = rollout
    engine = _engine(moe_model, "rollout", share_prompts=share, micro_batch_size=16)
    # a log-prob's fp32 spacing (one unit in the last place): -8 and -20 are 9.5e-7 and 1.9e-6 apart from
    # their neighbours, so an absolute bound would hold or fail by which logits this CPU rounds which way
    ulp = torch.nextafter(logp.abs(), torch.tensor(float("inf"))) - logp.abs()
    gaps, ulps = {}, {}
    for name, b in (("off", batch), ("on", dict(batch, routed_experts=routes))):
        out = engine.forward(b, ("log_probs",))["log_probs"]
        gaps[name] = float(((out - logp).abs() * mask).max())
        ulps[name] = float(((out - logp).abs() / ulp * mask).max())
        metrics = engine.route_metrics()
    print("rollout/training log-prob gap (max):", gaps, "in units of the last place:", ulps, metrics)
    assert ulps["on"] <= 4, (gaps, ulps)  # rounding: the engines' own arithmetic differs (kernels, order)
    assert gaps["off"] > 100 * max(gaps["on"], 1e-8), gaps  # some tokens routed otherwise without replay
    assert set(metrics) == {"moe/route_agreement", "moe/route_agreement/layer_0", "moe/route_agreement/layer_1"}
    assert 0.9 < metrics["moe/route_agreement"] < 1.0, metrics  # the misrouted tokens the off gap comes from


def test_old_mode_records_the_forwards_routes_and_the_update_replays_them(one_rank_world, moe_model, rollout):
    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig
    from verl_hpc.engines.megatron import Actor

    batch, rollout_routes, _, mask = rollout
    engine = _engine(moe_model, "old")
    acfg = ActorConfig(ppo_mini_batch_size=16, micro_batch_size=5)
    actor = Actor(engine, acfg)
    old = actor.log_probs(batch)
    routes = old["routed_experts"]
    assert routes.dtype == torch.uint8 and routes.shape == rollout_routes.shape
    length = batch["prompt_lengths"] + batch["response_lengths"]
    for i in range(len(length)):  # MISSING from the last token on, recorded before it
        assert bool((routes[i, length[i] - 1:] == MISSING[torch.uint8]).all())
        assert int(routes[i, :length[i] - 1].max()) < 4
    # the training forward's own routes differ from the rollout's where the rollout misrouted
    recorded = routes != MISSING[torch.uint8]
    assert bool((routes[recorded] != rollout_routes[recorded]).any())
    again = engine.forward(dict(batch, routed_experts=routes), ("log_probs",))["log_probs"]
    assert torch.equal(again, old["old_log_probs"])
    assert engine.route_metrics()["moe/route_agreement"] == 1.0
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    m = actor.update(dict(batch, routed_experts=routes, old_log_probs=old["old_log_probs"], advantages=adv),
                     PolicyObjective.from_config(acfg))
    # one mini-batch: the update's forward routes as the old forward did, every replayed slot agrees
    assert m["actor/moe/route_agreement"] == 1.0 and "actor/moe/route_agreement/layer_1" in m


def test_routes_are_cut_with_micro_batches_and_travel_through_a_split_runs_checkpoint(rollout):
    from verl_hpc.engines.batch import select_rows
    from verl_hpc.rollout.result import RolloutResult
    from verl_hpc.trainer.placement.inflight import InFlight

    batch, routes, _, _ = rollout
    sub = select_rows(dict(batch, routed_experts=routes), [0, 1], pad_seq_to=8)
    assert sub["routed_experts"].shape[:2] == sub["input_ids"].shape  # cut and padded like input_ids
    assert torch.equal(fit_width(routes[[0, 1]], sub["input_ids"].shape[1]), sub["routed_experts"])
    # split placement: in-flight samples keep their routes through the checkpoint's pickling
    rows = [routes[i, :int(batch["prompt_lengths"][i] + batch["response_lengths"][i]) - 1] for i in range(2)]
    result = RolloutResult(prompts=[[1, 2], [3]], prompt_index=[0, 1], sample_index=[0, 0],
                           response_ids=[[4], [5, 6]], logprobs=[[-1.0], [-1.0, -2.0]],
                           finish_reason=["stop", "stop"], routes=rows)
    flight = InFlight.start(1, None, [[1, 2], [3]], 0, 1)
    flight.fill(result, version=3)
    back = pickle.loads(pickle.dumps(flight)).result()
    assert all(torch.equal(a, b) for a, b in zip(back.routes, rows))
    assert RolloutResult.concat([back, back]).routes[2] is back.routes[0]
