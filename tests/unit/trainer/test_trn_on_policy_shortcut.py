"""The on-policy shortcut against the separate old-log-prob forward, through the real Megatron engine
(one gloo rank in this process, the tiny model): three actor updates with pi_old taken from the
update's own forward end in bitwise the same weights as three updates with pi_old from a separate
forward (trainer/stages/correction.py; PolicyObjective.old_from_update)."""
import torch


def _batches(steps: int, vocab: int):
    from verl_hpc.engines.batch import length_mask, pack_sequences

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (3, 5, 4, 6)]
        responses = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (4, 2, 3, 4)]
        b = pack_sequences(prompts, responses)
        b["response_mask"] = length_mask(b["response_lengths"], 4).float()
        b["advantages"] = torch.randn(b["response_mask"].shape, generator=g) * b["response_mask"]
        out.append(b)
    return out


def test_trn_shortcut_gives_bitwise_the_weights_of_the_separate_forward(one_rank_world, tmp_path):
    import dataclasses

    from verl_hpc.algorithms import PolicyObjective
    from verl_hpc.config.schema import ActorConfig, OptimConfig
    from verl_hpc.engines.megatron import Actor, default_options, MegatronEngine
    from verl_hpc.parallel import init_model_parallel

    from verl_hpc.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama", layers=2)
    init_model_parallel(1, 1)
    # temperature != 1: the old-log-prob forward and the update then compute log-probs the same way
    # (lm_outputs), so "the same" can be asked bitwise; a large LR makes a wrong pi_old show
    acfg = ActorConfig(ppo_mini_batch_size=4, micro_batch_size=2, entropy_coeff=0.01)
    loss = PolicyObjective.from_config(acfg)

    def run(shortcut: bool):
        torch.manual_seed(0)
        eng = MegatronEngine(default_options(model_path=str(model), optim=OptimConfig(lr=5e-2, clip_grad=0.0),
                                             micro_batch_size=2, total_steps=3, temperature=0.9))
        actor = Actor(eng, acfg)
        metrics = []
        for b in _batches(3, 250):
            if shortcut:
                metrics.append(actor.update(b, dataclasses.replace(loss, old_from_update=True)))
            else:
                b = dict(b, old_log_probs=actor.log_probs(b)["old_log_probs"])
                metrics.append(actor.update(b, loss))
        weights = {n: t.clone() for n, t in eng.export_hf_weights()}
        return weights, metrics

    sep_w, sep_m = run(False)
    cut_w, cut_m = run(True)
    start = {}
    from safetensors.torch import load_file
    for f in model.glob("*.safetensors"):
        start.update(load_file(str(f)))
    assert sep_w.keys() == cut_w.keys()
    moved = [n for n in sep_w if n in start and not torch.equal(sep_w[n], start[n])]
    assert moved, "the updates changed no weight: the comparison would prove nothing"
    differ = [n for n in sep_w if not torch.equal(sep_w[n], cut_w[n])]
    assert not differ, differ[:5]
    assert [m["actor/pg_loss"] for m in sep_m] == [m["actor/pg_loss"] for m in cut_m]
    assert all(m["actor/pg_clipfrac"] == 0.0 for m in cut_m)  # ratio exactly 1 on-policy
