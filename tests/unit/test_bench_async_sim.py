"""benchmarks/bench_async.py simulate: the simulated clock on cases computable by hand (constant
lengths, constant decode steps and train time: the closed-form step of colocated-sync, split k = 0
and split k = 1), the staleness bound, the long tail that asynchrony hides, the numbers it takes
from the plan, and the command line with its one-line errors."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_async as bench  # noqa: E402  (the entry point)
from async_rl import common, model  # noqa: E402

N = 2  # samples per prompt


def placement(engines, slots, train_s, *, alpha=1e-3, beta=1e-4, sync_s=0.05):
    """No KV term and no prompt: a decode step of b live sequences lasts alpha + beta * b."""
    return model.Placement(engines, slots, model.DecodeModel(alpha, beta, 0.0),
                           model.TrainModel(0.0, train_s), sync_s, prompt_tokens=0)


def constant(steps=8, prompts=8, length=100):
    return np.full((steps, prompts * N), length, dtype=np.int64)


def test_colocated_step_is_generate_plus_train_plus_sync():
    # 2 engines x 8 sequences of 100 tokens: 100 steps of 1e-3 + 8e-4 s
    p = placement(2, 8, train_s=0.3)
    res = model.simulate(p, constant(), N, 0, warmup=2, overlapped=False)
    assert res.step_s == pytest.approx(100 * 1.8e-3 + 0.3 + 0.05, rel=1e-9)


def test_split_on_policy_step_is_the_same_sum_on_fewer_gpus():
    # 1 engine x 16 sequences: 100 steps of 1e-3 + 16e-4 s; nothing overlaps at k = 0
    p = placement(1, 16, train_s=0.5)
    res = model.simulate(p, constant(), N, 0, warmup=2)
    gen = 100 * 2.6e-3
    assert res.step_s == pytest.approx(gen + 0.5 + 0.05, rel=1e-9)
    assert set(res.staleness) == {0}
    assert res.train_idle == pytest.approx(gen / (gen + 0.55), rel=1e-9)
    assert res.rollout_idle == pytest.approx(0.5 / (gen + 0.55), rel=1e-9)


@pytest.mark.parametrize("train_s", [0.1, 0.5])  # generation-bound, then training-bound
def test_one_step_off_step_is_the_slower_group_plus_the_sync(train_s):
    # slots = one batch's share: the next batch waits for free slots, so batches never share steps;
    # the sync stops both groups (the rollout loads the weights)
    p = placement(1, 16, train_s)
    res = model.simulate(p, constant(), N, 1, warmup=2)
    gen = 100 * 2.6e-3
    assert res.step_s == pytest.approx(max(gen, train_s) + 0.05, rel=1e-9)
    assert set(res.staleness) == {1}
    waiting = res.train_idle if gen > train_s else res.rollout_idle
    assert waiting == pytest.approx(abs(gen - train_s) / (max(gen, train_s) + 0.05), rel=1e-9)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_no_batch_is_older_than_k(k):
    lengths = model.lognormal_lengths(14, 16 * N, 60, 1.0, 400, seed=3)
    res = model.simulate(placement(2, 32, train_s=0.05), lengths, N, k, warmup=2)
    assert max(res.staleness) <= k
    assert max(res.staleness) == k  # the trainer is the faster group: the rollout runs k ahead


def test_a_long_tail_makes_asynchrony_worth_more():
    steps, prompts = 12, 32
    tail = model.lognormal_lengths(steps, prompts * N, 100, 1.2, 1500, seed=0)
    flat = np.full_like(tail, int(round(tail.mean())))

    def speedup(lengths):  # half the GPUs train twice as long; the same 10 batches on both sides
        colo = model.simulate(placement(4, 64, train_s=0.4), lengths, N, 0, 2, steps=10, overlapped=False)
        split = model.simulate(placement(2, 64, train_s=0.8), lengths, N, 1, 2, steps=10)
        return colo.step_s / split.step_s

    # colocated, every engine decodes its longest responses nearly alone while the trainer waits;
    # split, the next batch fills the slots they leave
    assert speedup(tail) > 1.1 * speedup(flat)


def _args(*extra):
    return bench.build_parser().parse_args(["simulate", *extra])


def test_the_clock_takes_its_times_from_the_plan():
    from verl_hpc.planning.suggest import step_time_parts

    args = _args()
    base = common.base_config(args)
    split = common.split_config(base, 32, 1)
    gpu = common._gpu(base)
    for cfg in (base, split):
        parts = step_time_parts(cfg, gpu)
        p = common.placement_from_plan(cfg, 1000.0, 512)
        rows = cfg.data.train_batch_size * cfg.rollout.n
        assert p.engines == cfg.rollout_world_size // cfg.rollout.tp
        assert p.sync_s == parts["weight_sync"]
        tokens = rows * (cfg.data.max_prompt_length + cfg.data.max_response_length)
        assert p.train.seconds(tokens) == pytest.approx(
            sum(parts[k] for k in ("forwards", "updates", "tp_comms", "dp_comms", "offload")))
        # the per-sequence decode cost is the plan's rollout time per generated token and engine
        assert p.decode.beta * rows * cfg.data.max_response_length / p.engines == pytest.approx(
            parts["rollout"])
    # each group's time is on its own GPUs: half the GPUs train, twice the forward time
    assert step_time_parts(split, gpu)["forwards"] == pytest.approx(2 * step_time_parts(base, gpu)["forwards"])
    assert step_time_parts(split, gpu)["rollout"] == pytest.approx(2 * step_time_parts(base, gpu)["rollout"])


def test_simulate_command_prints_ratios_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = bench.main(["simulate", "--gpus", "16", "--batch", "64", "--n", "4", "--steps", "6", "--warmup",
                     "2", "--ks", "0,1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["k"] for r in res["split"]] == [0, 1]
    assert [r["rollout_gpus"] for r in res["split"]] == [8, 8]  # one node of two
    on_policy, one_off = res["split"]
    assert on_policy["speedup"] < 1 < one_off["speedup"]  # k = 0 only splits the GPUs; k = 1 overlaps
    assert one_off["max_staleness"] == 1 and on_policy["max_staleness"] == 0
    assert f"{one_off['speedup']:.2f}x" in printed and "colocated-sync" in printed


@pytest.mark.parametrize("flags, says", [
    (["--gpus", "16", "--rollout-gpus", "16"], "error: --rollout-gpus 16: leaves no training GPU"),
    (["--gpus", "12"], "error: --gpus 12: not a multiple of slurm.gpus_per_node = 8"),
    (["--ks", "1,99"], "error: --ks '1,99': valid: staleness bounds in [0, 64]"),
    (["--steps", "4", "--warmup", "4"], "error: --warmup 4: valid: 0 .. --steps - 1 = 3"),
])
def test_bad_flags_are_one_line(flags, says, capsys):
    assert bench.main(["simulate", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1
