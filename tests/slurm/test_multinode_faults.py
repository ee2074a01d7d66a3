"""Faults across the nodes of a 2-node job (issue 14), each with its measured time printed.

* A node's ranks die (SIGKILL to every rank process the job has on node2, as the OOM killer or a
  crashing driver would): the job ends FAILED within 60 s and the submitter names the node, the
  ranks and their logs. (slurmstepd, Slurm's own agent, is left alive to report the deaths: with it
  gone too, srun waits for that node until slurmctld declares it dead, SlurmdTimeout later.)
* node2's link goes down in the middle of the collectives: every rank, on both sides, fails within
  the collective timeout with an error naming the collective and its group; no rank is left.
These use the smoke job (no model: all-reduces in a loop) to keep CPU use small; the warning
signal on a 2-node GRPO job is in test_multinode.py (it reuses the straight run there).
Needs `slurm/devcluster/start.sh --nodes 2`; fails, never skips.
"""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mn_helpers import REPO, assert_two_nodes, wait_for

# two-node jobs killed and cut off: make test-long
pytestmark = [pytest.mark.multinode, pytest.mark.long, pytest.mark.timeout(900)]
TIMEOUT_S = 20  # trainer.collective_timeout_s of the link test


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    assert_two_nodes()


def smoke(tmp_path, *extra):
    cmd = [sys.executable, "-m", "verl_hpc.submit", "configs/smoke.yaml", f"trainer.output_dir={tmp_path}/out",
           f"slurm.log_dir={tmp_path}/logs/%j", "slurm.nodes=2", "slurm.tasks_per_node=2", "slurm.time_min=5",
           "trainer.smoke.steps=5000", "trainer.smoke.step_seconds=0.05", "trainer.smoke.mpi=false",
           "slurm.max_restarts=0", *extra]  # the faults must end the job here (restarts: test_restarts_slurm.py)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_running(tmp_path, proc) -> str:
    """Wait until rank 0 logged 20 smoke steps; returns the job id."""
    def ready():
        assert proc.poll() is None, proc.communicate()
        logs = list((tmp_path / "logs").glob("*/*_0_log.err"))
        return logs and "smoke step 20/" in logs[0].read_text(errors="replace") and logs[0].parent.name
    return wait_for(ready, 300, "20 smoke steps on 2 nodes")


def job_pids_on(node: str, job_id: str) -> list[int]:
    """The job's rank processes inside `node`'s network namespace."""
    out = subprocess.run(["ip", "netns", "pids", f"vhpc-{node}"], capture_output=True, text=True).stdout
    pids = []
    for pid in out.split():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in env:
            pids.append(int(pid))
    return pids


def rank_logs(tmp_path, job_id) -> dict[int, str]:
    return {int(f.name.split("_")[1]): f.read_text(errors="replace")
            for f in (tmp_path / "logs" / job_id).glob(f"{job_id}_*_log.err")}


def test_node_ranks_killed_fail_job_fast_naming_node(tmp_path):
    proc = smoke(tmp_path)
    try:
        job_id = steps_running(tmp_path, proc)
        pids = job_pids_on("node2", job_id)
        assert len(pids) == 2, pids  # ranks 2 and 3
        t0 = time.time()
        for pid in pids:
            subprocess.run(["kill", "-9", str(pid)], check=True)
        out, err = proc.communicate(timeout=240)
        elapsed = time.time() - t0
    finally:
        proc.kill()
    print(f"\n[multinode] node2's ranks killed -> submitter returned after {elapsed:.1f}s")
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f}s to fail after node2's ranks died"
    assert "ended FAILED" in err, err[-3000:]
    lines = {int(m.group(1)): m for m in re.finditer(r"rank (\d+): (.*?) \(node (\S+)\); log: (\S+)", err)}
    for rank in (2, 3):
        assert rank in lines and lines[rank].group(3) == "node2", err[-3000:]
        assert "Killed" in lines[rank].group(2) or "signal 9" in lines[rank].group(2), err[-3000:]
        assert Path(lines[rank].group(4)).exists()


def test_link_down_fails_every_rank_within_collective_timeout(tmp_path):
    proc = smoke(tmp_path, f"trainer.collective_timeout_s={TIMEOUT_S}")
    link = ["ip", "-n", "vhpc-node2", "link", "set", "vheth0"]
    try:
        job_id = steps_running(tmp_path, proc)
        t0 = time.time()
        subprocess.run([*link, "down"], check=True)
        try:
            # every rank, node1's and node2's, must give up by itself within the timeout
            failed = wait_for(lambda: (lambda logs: len(logs) == 4 and all("CollectiveError" in t for t in logs.values())
                                       and logs)(rank_logs(tmp_path, job_id)),
                              TIMEOUT_S + 60, "all 4 ranks to report a CollectiveError")
            t_ranks = time.time() - t0
        finally:
            subprocess.run([*link, "up"], check=True)  # the node comes back; Slurm can clean up
        out, err = proc.communicate(timeout=240)
        t_job = time.time() - t0
    finally:
        subprocess.run([*link, "up"], check=False)
        proc.kill()
    print(f"\n[multinode] node2's link down -> all 4 ranks failed their collective after {t_ranks:.1f}s "
          f"(timeout {TIMEOUT_S}s), submitter returned after {t_job:.1f}s (link back up at {t_ranks:.1f}s)")
    assert t_ranks < TIMEOUT_S + 30, t_ranks
    for rank, text in failed.items():
        m = re.search(r"CollectiveError: collective (\w+) on group '(\w+)' \(ranks \[0, 1, 2, 3\]\) failed on "
                      rf"rank {rank} after ([\d.]+)s \(collective timeout {TIMEOUT_S}s\)", text)
        assert m, text[-3000:]
        assert m.group(1) == "all_reduce" and m.group(2) == "world"
    assert proc.returncode != 0 and "ended FAILED" in err, err[-3000:]
    assert wait_for(lambda: not job_pids_on("node1", job_id) and not job_pids_on("node2", job_id), 60,
                    "no rank process of the job left on either node")
