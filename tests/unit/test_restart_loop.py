"""The batch script's supervisor (launcher/restart_loop.py) around a stand-in srun: it relaunches a
step whose rank died, with the next VERL_HPC_ATTEMPT and --overlap, stops after slurm.max_restarts
with one line and exit 34, leaves an error a rank reported alone, ends a step whose rank stopped
beating, and never relaunches a job being stopped by a signal. The real srun and Slurm: the Slurm
tier (tests/slurm/test_restarts_slurm.py)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_hpc.launcher.restart_loop import srun_argv

pytestmark = pytest.mark.heavy  # starts processes
LOOP = Path(__file__).resolve().parents[2] / "verl_hpc" / "launcher" / "restart_loop.py"
# srun's report of a task that died and the one it then terminated (Slurm 22.05's words)
STUB_SRUN = r"""#!/bin/bash
echo "$VERL_HPC_ATTEMPT $*" >> "$STUB_DIR/launches"
echo "{\"checkpoint_dir\": \"$STUB_DIR/ckpt\"}" > "$VERL_HPC_HEARTBEAT_DIR/job.json"   # rank 0's word
died() {
  echo "srun: error: node2: task 1: $1" >&2
  echo "srun: launch/slurm: _step_signal: Terminating StepId=7.$VERL_HPC_ATTEMPT" >&2
  echo "srun: error: node1: task 0: Terminated" >&2
  exit 143
}
case "$STUB_MODE" in
  die_once) [ "$VERL_HPC_ATTEMPT" = 0 ] && died "Segmentation fault"; exit 0 ;;
  always) died Killed ;;
  error) echo "srun: error: node1: task 0: Exited with exit code 2" >&2; exit 2 ;;
  silent)
    if [ "$VERL_HPC_ATTEMPT" = 0 ]; then
      echo "5 12 $$ node2 1" > "$VERL_HPC_HEARTBEAT_DIR/rank1"   # one beat at step 12 (timeout 1 s), then none
      trap 'n=$((n+1)); [ "$n" = 2 ] && { echo ABORTED >> "$STUB_DIR/launches"; exit 130; }' INT
      n=0; while :; do sleep 0.1; done
    fi
    exit 0 ;;
  stopped) sleep 30 ;;
esac
"""


def supervise(tmp_path, mode, *, max_restarts=2, wait=True):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "srun").write_text(STUB_SRUN)
    (bindir / "srun").chmod(0o755)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    (tmp_path / "ckpt" / "latest").write_text("step_000011\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "VERL_HPC_"))}
    env.update(PATH=f"{bindir}:{env['PATH']}", STUB_DIR=str(tmp_path), STUB_MODE=mode)
    cmd = [sys.executable, str(LOOP), "--max-restarts", str(max_restarts), "--spare-nodes", "0",
           "--backoff-s", "0", "--run-dir", str(tmp_path / "run"),
           "--", "srun", "--mpi=pmix", "python", "-m", "verl_hpc.job"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err, (tmp_path / "launches").read_text().splitlines()


def test_a_dead_rank_is_relaunched_once_with_the_next_attempt(tmp_path):
    rc, out, err, launches = supervise(tmp_path, "die_once")
    assert rc == 0, out + err
    assert launches == ["0 --mpi=pmix python -m verl_hpc.job", "1 --overlap --open-mode=append --mpi=pmix python -m verl_hpc.job"]
    assert out.splitlines() == [
        "[restart] rank 1 on node node2 died (SIGSEGV); restarted from step 11 (1 of 2)",
        "[restart] the job finished after 1 restart(s) in this allocation"]
    assert "srun: error: node2: task 1: Segmentation fault" in err  # srun's own words reach the batch log
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()]
    assert row["action"] == "restart" and row["deaths"][0]["how"] == "SIGSEGV" and row["launch"] == 0


def test_spent_restarts_end_with_one_line_and_exit_34_never_a_loop(tmp_path):
    rc, out, _, launches = supervise(tmp_path, "always", max_restarts=1)
    assert rc == 34 and len(launches) == 2, launches
    assert out.splitlines()[-1] == ("[restart] rank 1 on node node2 died (SIGKILL); not restarted: the 1 restart(s) "
                                    "of slurm.max_restarts = 1 are spent; the job ends with its checkpoint of step 11")


def test_an_error_the_rank_reported_is_not_relaunched(tmp_path):
    rc, out, _, launches = supervise(tmp_path, "error")
    assert rc == 2 and len(launches) == 1
    assert "rank 0 on node node1 failed (exit code 2); not restarted: an error the rank reported" in out


def test_a_rank_whose_heartbeat_stops_ends_the_step_and_counts_as_dead(tmp_path):
    t0 = time.monotonic()
    rc, out, err, launches = supervise(tmp_path, "silent")
    assert rc == 0, out + err
    assert launches[1] == "ABORTED" and launches[2].startswith("1 --overlap"), launches  # srun's abort: 2 SIGINTs
    assert out.splitlines()[:2] == [
        "[restart] rank(s) 1: no heartbeat for 1 s (holding the GIL, stopped, or on a node that is gone): ending "
        "the job step",
        "[restart] rank 1 on node node2 stopped (no heartbeat for 1 s) at step 12; restarted from step 11 (1 of 2)"]
    assert time.monotonic() - t0 < 60  # the 1 s timeout, not a hang (loose: a loaded machine starts processes slowly)


def test_a_job_being_stopped_is_not_relaunched(tmp_path):
    proc = supervise(tmp_path, "stopped", wait=False)
    end = time.time() + 20
    while not (tmp_path / "launches").exists() and time.time() < end:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # scancel, a preemption, the time limit: Slurm signals the job's processes
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and out == "", out + err
    assert len((tmp_path / "launches").read_text().splitlines()) == 1


def test_srun_gets_the_layout_only_where_the_allocation_has_spares():
    cmd = ["srun", "--mpi=pmix", "python"]
    assert srun_argv(cmd, spare_nodes=0, nodes=2, tasks_per_node=4, exclude=[], relaunch=False) == cmd
    assert srun_argv(cmd, spare_nodes=1, nodes=2, tasks_per_node=4, exclude=["n1", "n3"], relaunch=True) == [
        "srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--exclude=n1,n3", "--overlap", "--open-mode=append", "--mpi=pmix",
        "python"]


STUB_SCONTROL = r"""#!/bin/bash
echo "$*" >> "$STUB_DIR/scontrol"
case "$1 $2" in
  "show job") echo "JobId=7 JobState=RUNNING NodeList=node[1-2] NumNodes=2" ;;
  "show hostnames") printf 'node1\nnode2\n' ;;
  "show node") echo "NodeName=node1 State=MIXED CPUs=8"; echo "NodeName=node2 State=DOWN+NOT_RESPONDING CPUs=8" ;;
  "requeue 7") exit 0 ;;
esac
"""
LOST_NODE_SRUN = r"""#!/bin/bash
echo "$VERL_HPC_ATTEMPT $*" >> "$STUB_DIR/launches"
case "$*" in *--nodelist=node2*) exit 1 ;; esac   # the probe: node2 does not answer
echo "{\"checkpoint_dir\": \"$STUB_DIR/ckpt\"}" > "$VERL_HPC_HEARTBEAT_DIR/job.json"
echo "srun: error: Node failure on node2" >&2
echo "srun: error: node2: tasks 2-3: Killed" >&2
exit 1
"""


def test_a_lost_node_without_a_spare_requeues_the_job_as_slurm_would(tmp_path):
    """2 nodes, no spare, node2 lost (srun's node failure, Slurm's DOWN): the layout no longer
    fits, so one line and `scontrol requeue`, whatever the restarts left; no relaunch."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("srun", LOST_NODE_SRUN), ("scontrol", STUB_SCONTROL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step_000011\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "VERL_HPC_"))}
    env.update(PATH=f"{bindir}:{env['PATH']}", STUB_DIR=str(tmp_path), SLURM_JOB_ID="7", SLURMD_NODENAME="node1",
               SLURM_NTASKS_PER_NODE="2")
    done = subprocess.run([sys.executable, str(LOOP), "--max-restarts", "2", "--spare-nodes", "0", "--backoff-s", "0",
                           "--run-dir", str(tmp_path / "run"), "--requeue", "--", "srun", "python"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "[restart] ranks 2, 3 on node node2 died (SIGKILL); not restarted: node(s) node2 lost and 1 node(s) left, "
        "the layout takes 2 (slurm.spare_nodes = 0); requeued: it resumes from step 11 on a new allocation"]
    assert "requeue 7" in (tmp_path / "scontrol").read_text().splitlines()
    assert len((tmp_path / "launches").read_text().splitlines()) == 1  # no relaunch (and no probe: node2 was DOWN)
