"""A GRPO job across two dev-cluster nodes is the same job as on one node, through preemption too
(issue 14; the warning-signal requeue of issue 7).

Four tiny GRPO jobs of 4 ranks each (TP2 inside a node, DP2 across nodes on 2 nodes x 2 ranks;
the same TP2 x DP2 layout on 1 node x 4 ranks), through both entry points of a user:
  A: 2 nodes x 2, `python -m verl_hpc.submit`, 4 steps, sent Slurm's warning signal (USR2) early:
     it checkpoints, requeues itself, resumes from `latest` and completes
  B: 1 node x 4, `sbatch launch/dev/...`, 4 steps straight
  C: 1 node x 4, submit, resumes A's step-2 checkpoint -> 3  D: 2 nodes x 2, sbatch, resumes B's -> 3
A (signalled, requeued, resumed on 2 nodes) and B (straight on 1 node) agree bitwise (model and
optimizer) at steps 2 and 4: the 2-node run is the 1-node run, and the requeue lost and repeated
nothing; C and D equal A at step 3: a checkpoint written by 4 ranks on 2 nodes resumes on 1 node and
the reverse. A's ranks must have found the rendezvous on the first host of the nodelist and their
node-local ranks, with every TP group inside one node. Slurm's hold of a requeued job (120 s) is
released as an admin would (rl_job.release_requeue_hold).
Needs `slurm/devcluster/start.sh --nodes 2` (what `make cluster` starts); fails, never skips.
"""
import json
import subprocess
import time

import pytest
import torch

from jobs import read_all
from mn_helpers import all_logs, assert_two_nodes, finish, rank_lines, sbatch_grpo, submit_grpo, wait_for
from rl_job import release_requeue_hold, sacct_states, steps_logged

# a loaded 2-core machine needs minutes per 4-rank job (imports, Megatron init)
# two-node jobs and their chains of launches: make test-long
pytestmark = [pytest.mark.multinode, pytest.mark.long, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    assert_two_nodes()


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets


def _pair(first, second, timeout=600):
    """Run two jobs at once (they fit side by side on the 2 nodes); both must succeed."""
    t0 = time.time()
    (p1, out1), (p2, out2) = first(), second()
    rc1, log1 = finish(p1, out1, timeout)
    rc2, log2 = finish(p2, out2, timeout)
    assert rc1 == 0, log1[-12000:]
    assert rc2 == 0, log2[-12000:]
    return log1, log2, time.time() - t0


def _signal_once_placed(proc, out) -> str:
    """Send USR2 to A once Megatron is up (the signal handlers long installed), before the first
    step ends; then release Slurm's requeue hold. Returns the job id."""
    def placed():
        assert proc.poll() is None, proc.communicate()
        logs = list((out / "logs").glob("*/*_0_log.err"))
        return logs and "placement:" in logs[0].read_text(errors="replace") and logs[0].parent.name
    job_id = wait_for(placed, 600, "job A's ranks to initialise")
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    assert release_requeue_hold(job_id, proc), "job A ended without being requeued: " + all_logs(out)[-6000:]
    return job_id


@pytest.fixture(scope="module")
def two_steps(assets, tmp_path_factory):
    base = tmp_path_factory.mktemp("mn_two_steps")
    a, b = base / "a_2x2", base / "b_1x4"
    every = ["trainer.total_steps=4", "checkpoint.save_every=1", "checkpoint.keep_last=0"]
    t0 = time.time()
    pa = submit_grpo(assets, a, 2, 2, *every, "slurm.requeue=true")
    pb = sbatch_grpo(assets, b, 1, 4, *every)
    try:
        job_a = _signal_once_placed(pa, a)
        rc_a, log_a = finish(pa, a)
        rc_b, log_b = finish(pb, b)
    finally:
        for p in (pa, pb):
            if p.poll() is None:
                p.kill()
    assert rc_a == 0, log_a[-12000:]
    assert rc_b == 0, log_b[-12000:]
    print(f"\n[multinode] A (2 nodes x 2, submit, USR2 + requeue + resume) and B (1 node x 4, sbatch), "
          f"4 GRPO steps each: {time.time() - t0:.0f}s wall together")
    return dict(a=a, b=b, job_a=job_a, stdout_a=log_a)


def test_rendezvous_and_local_ranks_from_the_nodelist(two_steps):
    log_a = all_logs(two_steps["a"], tail=10**7)
    ranks = rank_lines(log_a)
    assert sorted(ranks) == [0, 1, 2, 3], log_a[-6000:]
    for r, x in ranks.items():
        # srun's block distribution: ranks 0,1 on node1 and 2,3 on node2
        assert (x["world"], x["host"], x["node"], x["local"]) == (4, f"node{r // 2 + 1}", r // 2, r % 2), (r, x)
        assert x["master"] == "node1", x  # the first host of SLURM_JOB_NODELIST=node[1-2]
    assert len({x["port"] for x in ranks.values()}) == 1
    assert ("TP groups each inside one node [(0, 1), (2, 3)]; DP groups span up to 2 node(s) "
            "[(0, 2), (1, 3)]") in log_a, log_a[-6000:]
    one_node = rank_lines(all_logs(two_steps["b"], tail=10**7))
    assert {x["host"] for x in one_node.values()} == {one_node[0]["host"]}
    assert [one_node[r]["local"] for r in range(4)] == [0, 1, 2, 3]


def _bitwise(x, y, what):
    ta, tb = read_all(x), read_all(y)
    assert sorted(ta) == sorted(tb) and any(n.startswith("actor/optim/") for n in ta), what
    differ = [n for n in ta if not torch.equal(ta[n], tb[n])]
    print(f"[multinode] {what}: {len(ta)} tensors, {len(differ)} differ")
    assert not differ, f"{what}: not bitwise equal: {differ[:5]}"
    return ta


def ckpt(out, step):
    return out / "checkpoints" / f"step_{step:06d}"


def test_two_nodes_equal_one_node_bitwise(two_steps):
    for step in (2, 4):
        _bitwise(ckpt(two_steps["a"], step), ckpt(two_steps["b"], step),
                 f"2 nodes x 2 (TP2 in node, DP2 across) vs 1 node x 4, step {step}")
    first, last = read_all(ckpt(two_steps["a"], 1)), read_all(ckpt(two_steps["a"], 4))
    assert any(not torch.equal(first[n], last[n]) for n in last if n.startswith("actor/model/")), \
        "the weights never moved"


def test_checkpoint_crosses_between_two_nodes_and_one(two_steps, assets, tmp_path):
    c, d = tmp_path / "c_1x4_from_2x2", tmp_path / "d_2x2_from_1x4"
    from_a = f"trainer.resume={two_steps['a']}/checkpoints/step_000002"
    from_b = f"trainer.resume={two_steps['b']}/checkpoints/step_000002"
    _, _, seconds = _pair(
        lambda: (submit_grpo(assets, c, 1, 4, "trainer.total_steps=3", from_a), c),
        lambda: (sbatch_grpo(assets, d, 2, 2, "trainer.total_steps=3", from_b), d))
    print(f"\n[multinode] C (1 node x 4 from A's 2-node checkpoint) and D (2 nodes x 2 from B's "
          f"1-node checkpoint), step 3: {seconds:.0f}s wall together")
    for out in (c, d):
        assert "continuing at step 3" in all_logs(out, tail=10**7), all_logs(out)[-3000:]
    assert {x["host"] for x in rank_lines(all_logs(d, tail=10**7)).values()} == {"node1", "node2"}
    _bitwise(ckpt(c, 3), ckpt(two_steps["a"], 3), "step 3 resumed on 1 node from 2 nodes vs straight on 2")
    _bitwise(ckpt(d, 3), ckpt(two_steps["a"], 3), "step 3 resumed on 2 nodes from 1 node vs straight on 2")


def test_warning_signal_on_two_nodes_checkpoints_requeues_resumes_exactly(two_steps):
    """A was signalled, checkpointed, requeued and resumed; what it logged and left says so (its
    bitwise equality with the straight run B is test_two_nodes_equal_one_node_bitwise)."""
    a, job_id = two_steps["a"], two_steps["job_a"]
    full = all_logs(a, tail=10**7)  # both attempts: a requeued task appends to its log
    assert "received SIGUSR2" in full and "requeued after the checkpoint of step" in full, full[-8000:]
    assert "COMPLETED" in two_steps["stdout_a"], two_steps["stdout_a"][-3000:]  # the submitter waited it out
    summary = json.loads((a / "rl_summary.json").read_text())
    assert summary["steps"] == 4 and summary["stopped"] == "completed", summary
    assert 0 < summary["resumed_from"] < 4, summary
    assert steps_logged(a) == [1, 2, 3, 4]  # no step lost or logged twice across the requeue
    assert (a / "checkpoints" / "latest").read_text().strip() == "step_000004"
    sacct = sacct_states(job_id)
    assert "REQUEUED" in sacct and sacct[-1] == "COMPLETED", sacct
    assert {x["host"] for x in rank_lines(full).values()} == {"node1", "node2"}
