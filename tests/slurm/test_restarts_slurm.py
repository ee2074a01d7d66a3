"""In-allocation restarts on the dev cluster (issue 94, item 3): the batch script's supervisor
(launcher/restart_loop.py) runs srun again inside the same allocation when a rank dies, and the
job finishes without a requeue.

* A smoke job's rank SIGKILLed (make test): srun's report names it, the ranks are launched again in
  the same job, the submitter streams the `[restart]` line and ends COMPLETED saying so.
* A tiny GRPO job's rank SIGKILLed mid-step (long): every step done, the restart counted, the final
  weights bitwise those of the same job without the fault.
* A node whose slurmd is stopped (its ranks killed with it, as a node going down) in a 1-node job
  with a spare node (long, 2 nodes): the node is left out at once (it does not answer a one-task
  step), the spare takes the ranks, the job ends bitwise as without the fault.
Needs the dev cluster (`make cluster`); fails, never skips.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from jobs import MOVING, data_overrides, logs, read_all, run_job, stable_metrics
from mn_helpers import assert_two_nodes, wait_for

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
GRPO = ["rollout.engine=hf", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=4", "trainer.val_every=0", "tracking.backends=[jsonl]", "tracking.plots=false",
        f"trainer.total_steps={STEPS}", "checkpoint.save_every=1", "slurm.restart_backoff_s=1", *MOVING]


@pytest.fixture(scope="module", autouse=True)
def cluster_is_up():
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and {"idle", "mixed", "allocated"} & set(r.stdout.split()), (
        f"dev cluster not usable (sinfo: {r.stdout!r} {r.stderr!r}); run slurm/devcluster/start.sh")


def submit(config: str, out: Path, *args, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "verl_hpc.submit", config, f"trainer.output_dir={out}",
           f"slurm.log_dir={out}/logs/%j", "slurm.time_min=15", *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or dict(os.environ))


def beat(out: Path, launch: int, rank: int):
    """(step, pid, node) of a rank's latest heartbeat in a launch, or None."""
    from verl_hpc.launcher import heartbeat

    found = sorted(out.glob(f"logs/*/heartbeats/launch{launch}/rank{rank}"))
    b = heartbeat.read(str(found[0])) if found else None
    return (b.step, b.pid, b.host) if b is not None else None


def no_requeue(job_id: str):
    """sacct's view: one run of the job, never requeued (no REQUEUED or NODE_FAIL record)."""
    states = subprocess.run(["sacct", "-n", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                            text=True, timeout=30).stdout.split()
    assert states and not {"REQUEUED", "NODE_FAIL", "PREEMPTED"} & set(states), states


def test_a_killed_rank_is_relaunched_inside_the_allocation(tmp_path):
    out = tmp_path / "out"
    proc = submit("configs/smoke.yaml", out, "slurm.tasks_per_node=2", "trainer.smoke.steps=30",
                  "trainer.smoke.step_seconds=0.3", "slurm.restart_backoff_s=1")
    try:
        _, pid, node = wait_for(lambda: (lambda b: b and b[0] == 0 and b)(beat(out, 0, 1)), 300,
                                "rank 1's first heartbeat")
        os.kill(pid, signal.SIGKILL)  # the OOM killer's way (a node's ranks are the same processes)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    text = stdout + stderr
    assert proc.returncode == 0, text[-6000:]
    assert f"[restart] rank 1 on node {node} died (SIGKILL); restarted from the start (no checkpoint yet) (1 of 2)" \
        in stdout, text[-6000:]  # the smoke job keeps no checkpoint
    m = re.search(r"\[submit\] job (\d+) COMPLETED in \d+s after 1 in-allocation restart\(s\)", stdout)
    assert m, stdout[-3000:]
    assert json.loads((out / "smoke_result.json").read_text())["steps"] == 30
    no_requeue(m.group(1))


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory):
    """The same 2-rank job without a fault, run here (`submit --local`): the same arithmetic as srun's."""
    out = tmp_path_factory.mktemp("straight")
    proc, summary = run_job("configs/demo_rl.yaml", out, f"model.path={tiny_assets}/model",
                            *data_overrides(tiny_assets), *GRPO, ranks=2, timeout=600)
    assert proc.returncode == 0, logs(proc, out)
    return out


STAMP = re.compile(r"^\[rank\d+\] (\d\d):(\d\d):(\d\d) .*?(injecting| up via |resume: loaded|checkpoint: step (\d+) ->)")


def timeline(out: Path) -> str:
    """From rank 0's log (both launches, appended): the fault's line (the injection, or the first
    launch's last step saved), the relaunched ranks up, resumed, and back at the step they died in."""
    events = []
    for line in sorted(out.glob("logs/*/*_0_log.err"))[0].read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m:
            events.append((int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)), m.group(4), m.group(5)))
    ups = [t for t, what, _ in events if what == " up via "]
    before = [e for e in events if e[0] <= ups[1]]
    t0 = max(t for t, what, _ in before if what == "injecting" or what.startswith("checkpoint"))
    resumed = next(t for t, what, _ in events if what == "resume: loaded" and t >= ups[1])
    saved = [(t, int(n)) for t, what, n in events if n and t >= resumed]
    return (f"relaunched ranks up {ups[1] - t0} s after the fault, checkpoint loaded {resumed - t0} s, "
            f"its next step saved {saved[0][0] - t0} s")


def ends_as_straight(straight: Path, out: Path, text: str):
    summary = json.loads((out / "rl_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["restarts"] == 1, text[-6000:]
    a, b = read_all(straight / "checkpoints"), read_all(out / "checkpoints")
    assert sorted(a) == sorted(b) and [n for n in a if not torch.equal(a[n], b[n])] == []  # bitwise
    drop = lambda rows: [{k: v for k, v in r.items() if k != "job/restarts"} for r in rows]  # noqa: E731
    assert drop(stable_metrics(straight)) == drop(stable_metrics(out))


@pytest.mark.long  # two launches of a GRPO job on the cluster (make test: the smoke job's relaunch)
def test_a_rank_sigkilled_mid_step_is_relaunched_and_ends_bitwise(tiny_assets, straight, tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = submit("configs/demo_rl.yaml", out, f"model.path={tiny_assets}/model", *data_overrides(tiny_assets),
                  *GRPO, "slurm.tasks_per_node=2", env=dict(os.environ, VERL_HPC_FAULT="step:1:3:sigkill"))
    stdout, stderr = proc.communicate(timeout=900)
    text = stdout + stderr
    assert proc.returncode == 0, text[-6000:]
    m = re.search(r"\[restart\] rank 1 on node (\S+) died \(SIGKILL\) at step 3; restarted from step 2 \(1 of 2\)",
                  stdout)
    assert m, text[-6000:]
    job_id = re.search(r"\[submit\] job (\d+) COMPLETED .* after 1 in-allocation restart", stdout).group(1)
    no_requeue(job_id)
    ends_as_straight(straight, out, text)
    print(f"\n[restarts slurm] rank SIGKILLed at step 3: the job took {time.monotonic() - t0:.0f} s; {timeline(out)}")


def slurmd_pid(node: str) -> int:
    return int(Path(f"/run/slurmd-{node}.pid").read_text())


@pytest.mark.long  # stops a node's slurmd, then waits for it to come back
@pytest.mark.multinode
def test_a_node_whose_slurmd_is_stopped_is_left_out_and_the_spare_takes_its_ranks(tiny_assets, straight, tmp_path):
    """1 node of ranks + 1 spare: the ranks start on node2 (node1, the batch host, is the spare).
    At step 2 node2 goes down: its slurmd is stopped and the job's ranks there are killed (what a
    node's loss does to them). srun reports the deaths; node2 does not answer a one-task step, so
    it is left out at once and the ranks run again on node1, from step 1's checkpoint."""
    assert_two_nodes()
    out = tmp_path / "out"
    proc = submit("configs/demo_rl.yaml", out, f"model.path={tiny_assets}/model", *data_overrides(tiny_assets),
                  *GRPO, "slurm.nodes=1", "slurm.spare_nodes=1", "slurm.tasks_per_node=2")
    stopped = None
    try:
        step, pid1, node = wait_for(lambda: (lambda b: b and b[0] >= 2 and b)(beat(out, 0, 1)), 600,
                                    "rank 1 at step 2")
        assert node == "node2", node  # the batch host (node1) is the spare
        pid0 = beat(out, 0, 0)[1]
        stopped = slurmd_pid(node)
        os.kill(stopped, signal.SIGKILL)  # the node goes down: its slurmd first, then its ranks
        for pid in (pid0, pid1):
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
        if stopped is not None:  # the node comes back for the tests after this one
            subprocess.run(["bash", "slurm/devcluster/start.sh", "--nodes", "2"], cwd=REPO, capture_output=True,
                           timeout=300)
    text = stdout + stderr
    assert proc.returncode == 0, text[-8000:]
    # the step the ranks were in when the kill landed (2, or 3 where step 2 ended first): its checkpoint one
    # before, or its own where the kill landed after that step's save and before the next began (0.2 s a step)
    m = re.search(r"\[restart\] ranks 0, 1 on node node2 died \(SIGKILL\) at step (\d); node node2 left out "
                  r"\(lost\); the ranks run on node1 now; restarted from step (\d) \(1 of 2\)", stdout)
    assert m and int(m.group(2)) in (int(m.group(1)) - 1, int(m.group(1))), text[-8000:]
    job_id = re.search(r"\[submit\] job (\d+) COMPLETED .* after 1 in-allocation restart", stdout).group(1)
    no_requeue(job_id)
    ends_as_straight(straight, out, text)
    print(f"\n[restarts slurm] node2's slurmd stopped at step {m.group(1)}: {timeline(out)}")
