"""benchmarks/bench_async.py simulate-elastic: the simulated cluster with an elastic rollout pool.

It runs on the project's Ledger, and a whole churny run answers as on a plain-scan copy of its rules;
the clock agrees with bench_async.simulate where both can be computed by hand; under heavy churn
(workers preempted, killed, slow; stragglers re-dispatched) every sample of every step is trained
exactly once, no batch is older than k, and no token is generated twice unless a worker died or
regeneration was asked for; a pool that never gets a worker going changes nothing; more backfill
windows do not lower throughput over seeds; the backfill windows follow the fitted shape; and the
command line runs and writes its JSON and plot."""
import collections
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_async as bench  # noqa: E402  (the entry point)
from async_rl import model  # noqa: E402
from async_rl.backfill import BackfillModel, Window, idle_nodes  # noqa: E402
from async_rl.elastic_sim import ElasticSim, Prefix, Setup  # noqa: E402
from elastic_naive_ledger import NaiveLedger  # noqa: E402
from verl_hpc.trainer.placement.elastic.ledger import Ledger  # noqa: E402

N = 2  # samples per prompt


def placement(engines=2, slots=8, train_s=0.3, *, alpha=1e-3, beta=1e-4, sync_s=0.05):
    return model.Placement(engines, slots, model.DecodeModel(alpha, beta, 0.0), model.TrainModel(0.0, train_s), sync_s,
                           prompt_tokens=0)


def churn(seed, nodes=12, kill=0.3, slow=0.3, idle=0.5):
    """Short windows on many nodes: workers join and leave every step or two."""
    return BackfillModel(median_s=1.5, sigma=1.0, idle_fraction=idle, kill_fraction=kill,
                         slow_fraction=slow).windows(range(nodes), seed, until_s=200.0)


def churny_setup(k=1, keep=True, **kw):
    return Setup(placement(**kw), k, worker_engines=2, worker_gpus=2, startup_s=0.2, deadline_s=0.4, heartbeat_s=0.1,
                 keep_prefixes=keep, slowdown=6.0)


def lengths(steps, prompts, seed=0, median=40, cap=200):
    return model.lognormal_lengths(steps, prompts * N, median, 1.0, cap, seed)


# ----------------------------------------------------------------------------- the book
def test_the_whole_run_is_the_same_on_a_plain_scan_book():
    L = lengths(12, 8)
    setup = churny_setup(engines=1, slots=4)
    runs = [ElasticSim(setup, L, N, 12, churn(1), book=book, record=True).run() for book in (Ledger, NaiveLedger)]
    a, b = runs
    assert a.step_end == b.step_end and a.staleness == b.staleness and a.trained_keys == b.trained_keys
    assert a.stats == b.stats and a.pool == b.pool and a.handed_back == b.handed_back
    assert a.joins > 3 and a.stats["returned"] > 0 and a.handed_back > 0


# ----------------------------------------------------------------------------- the clock
@pytest.mark.parametrize("engines, slots, train_s, k", [(2, 8, 0.3, 0), (1, 16, 0.5, 0), (1, 16, 0.1, 1),
                                                        (1, 16, 0.5, 1)])
def test_constant_lengths_give_bench_async_clock(engines, slots, train_s, k):
    # every engine holds exactly its share, so pulling leases = dealing the batch: the same steps
    p, L = placement(engines, slots, train_s), np.full((8, 8 * N), 100, dtype=np.int64)
    old = model.simulate(p, L, N, k, warmup=2)
    U = ElasticSim(Setup(p, k), L, N, 8 - (k + 1)).run().step_end
    assert (U[-1] - U[2]) / (len(U) - 3) == pytest.approx(old.step_s, rel=1e-9)


def test_colocated_is_generate_train_sync_in_turn():
    p, L = placement(2, 8, 0.3), np.full((8, 8 * N), 100, dtype=np.int64)
    out = ElasticSim(Setup(p, 3, colocated=True), L, N, 8).run()
    assert np.diff(out.step_end) == pytest.approx([100 * 1.8e-3 + 0.3 + 0.05] * 8, rel=1e-9)
    assert set(out.staleness) == {0}  # k is 0 when the same GPUs roll out and train


# ----------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("seed, keep", [(0, True), (1, True), (2, False)])
def test_under_churn_every_sample_is_trained_exactly_once(seed, keep):
    steps, prompts, k = 30, 8, 2
    L = lengths(steps, prompts, seed)
    out = ElasticSim(churny_setup(k, keep), L, N, steps, churn(seed), record=True).run()
    want = [(s, i, j) for s in range(1, steps + 1) for i in range(prompts) for j in range(N)]
    assert collections.Counter(out.trained_keys) == collections.Counter(want)  # none lost, none twice
    assert out.accepted == len(want) and out.completions == out.accepted + out.stats["duplicates"]
    assert max(out.staleness) <= k
    assert out.joins > 10 and out.leaves["preempted"] > 3 and out.leaves["no heartbeat"] > 0
    assert out.stats["redispatched"] > 0 and out.handed_back > 0  # stragglers and leavers both happened
    assert out.generated_tokens > out.trained_tokens  # dead workers' tokens, copies, restarts: redone


def test_goodbyes_with_prefixes_generate_no_token_twice():
    # no worker dies or straggles: whatever a leaver had generated is continued, not redone
    L = lengths(30, 8, 4)
    setup = Setup(placement(), 2, worker_engines=2, worker_gpus=2, startup_s=0.2, deadline_s=1e9, heartbeat_s=0.1)
    out = ElasticSim(setup, L, N, 30, churn(4, kill=0, slow=0)).run()
    assert out.handed_back > 20 and out.stats["duplicates"] == 0
    # a prefix is kept in whole tokens: at most one token per handed-back sample is decoded again
    assert out.trained_tokens <= out.generated_tokens <= out.trained_tokens + out.handed_back
    regen = ElasticSim(Setup(**{**setup.__dict__, "keep_prefixes": False}), L, N, 30, churn(4, kill=0, slow=0)).run()
    assert regen.generated_tokens > out.generated_tokens + 10 * out.handed_back


def test_a_pool_that_never_gets_going_changes_nothing():
    L = lengths(20, 8, 5)
    setup = churny_setup(2)
    fixed = ElasticSim(setup, L, N, 20).run()
    # windows shorter than the start-up (worker never generates) and windows after the run's end
    useless = [Window(i, 0.3 * i, 0.3 * i + 0.15, killed=bool(i % 2)) for i in range(40)]
    late = [Window(i, fixed.end_s + 1 + i, fixed.end_s + 50) for i in range(5)]
    out = ElasticSim(setup, L, N, 20, useless + late).run()
    assert out.step_end == fixed.step_end and out.staleness == fixed.staleness
    assert out.joins == 0 and out.stats == fixed.stats
    held = sum(2 * (min(w.end, out.end_s) - w.start) for w in useless if w.start < out.end_s)
    assert out.backfill_gpu_s == pytest.approx(held) and held > 0 and out.backfill_generating_gpu_s == 0


def test_more_backfill_windows_do_not_lower_throughput_over_seeds():
    # generation-bound: 1 own engine, a fast trainer; windows of healthy workers only. More nodes add
    # windows and change none of the others' (each node draws from its own stream).
    steps, prompts = 25, 16
    setup = Setup(placement(1, 8, 0.05), 2, worker_engines=1, worker_gpus=1, startup_s=0.3, deadline_s=1e9,
                  heartbeat_s=0.1)

    def rate(nodes, seed):
        model = BackfillModel(median_s=4.0, sigma=1.0, idle_fraction=0.3)
        out = ElasticSim(setup, lengths(steps, prompts, seed), N, steps, model.windows(range(nodes), seed, 1e4)).run()
        return steps / out.end_s

    rates = {nodes: [rate(nodes, seed) for seed in range(6)] for nodes in (0, 2, 6)}
    means = [float(np.mean(rates[nodes])) for nodes in (0, 2, 6)]
    assert means[0] < means[1] < means[2]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(rates[0], rates[6]))  # and in every seed here


# ----------------------------------------------------------------------------- the windows
def test_windows_follow_the_fitted_shape_and_each_node_its_own_stream():
    model = BackfillModel()
    horizon = 4e6
    ws = model.windows(range(40), 3, horizon)
    lengths_s = np.array([w.end - w.start for w in ws if w.start > 0])
    assert np.median(lengths_s) == pytest.approx(511, rel=0.08)
    assert np.std(np.log(lengths_s)) == pytest.approx(1.304, rel=0.05)
    idle = sum(min(w.end, horizon) - w.start for w in ws) / (40 * horizon)
    assert idle == pytest.approx(0.083, rel=0.08)
    more = model.windows(range(60), 3, horizon)
    assert [w for w in more if w.node < 40] == ws
    t = np.array([0.0, ws[0].start + 1e-3])
    assert idle_nodes(ws, t)[1] >= 1
    assert BackfillModel(idle_fraction=0.0).windows(range(5), 0, 1e5) == []


# ----------------------------------------------------------------------------- the command
def test_simulate_elastic_command_prints_the_three_placements_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "elastic.json", tmp_path / "pool.png"
    rc = bench.main(["simulate-elastic", "--gpus", "16", "--cluster-nodes", "8", "--batch", "64", "--n", "4",
                     "--target-steps", "16", "--warmup", "2", "--seeds", "0", "--idle-fraction", "0.5",
                     "--k", "2", "--set", "placement.elastic.straggler_deadline_s=250", "--out", str(out),
                     "--plot", str(png)])
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out.read_text())
    names = [r["name"] for r in res["placements"]]
    assert names == ["colocated", "fixed split", "fixed split + elastic pool"]
    colo, fixed, elastic = res["placements"]
    assert colo["backfill_gpu_h"] == fixed["backfill_gpu_h"] == 0 < elastic["backfill_gpu_h"]
    assert elastic["joins"] > 0 and all(r["max_staleness"] <= 2 for r in res["placements"])
    assert all(r["trained"] == 16 * 64 * 4 == r["accepted"] for r in res["placements"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "fixed split + elastic pool" in printed and f"{elastic['samples_per_hour']:,.0f}" in printed
    assert math.isclose(res["backfill"]["median_s"], 511.0)
    # the pool's rules are the config's placement.elastic: its deadline, and lost samples regenerated
    assert res["worker"]["deadline_s"] == 250 and res["worker"]["keep_prefixes"] is False
    assert res["worker"]["engines"] == 8  # a window's node runs one worker per GPU (rollout.tp 1)


@pytest.mark.parametrize("flags, says", [
    (["--cluster-nodes", "8"], "error: --cluster-nodes 8: holds no node besides the run's --gpus 64"),
    (["--kill-fraction", "1.5"], "error: --kill-fraction 1.5: valid: a fraction in [0, 1]"),
    (["--target-steps", "5", "--warmup", "5"], "error: --warmup 5: valid: 0 .. --target-steps - 1 = 4"),
    (["--seeds", "a"], "error: --seeds 'a': valid: seeds >= 0"),
    (["--k", "99"], "error: --k 99: valid: a staleness bound in [0, 64]"),
    (["--heartbeat", "100", "--deadline", "100", "--target-steps", "3", "--warmup", "1"],
     "error: --heartbeat 100: valid: below the straggler deadline 100 s"),
])
def test_bad_flags_are_one_line(flags, says, capsys):
    assert bench.main(["simulate-elastic", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1
