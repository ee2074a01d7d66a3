"""The in-allocation restart's rules (launcher/restarts.py) and heartbeats (launcher/heartbeat.py):
who counts as dead, which node is left out, when the restarts stop, the lines, the back-off.
srun's words below are what Slurm 22.05's srun printed on the dev cluster for a 2-task step
with --kill-on-bad-exit=1 (a task's SIGSEGV, SIGKILL, exit 3; a node's slurmd gone)."""
import ast
import signal
import sys
from pathlib import Path

import pytest

from verl_hpc.launcher import heartbeat, restarts
from verl_hpc.runtime import heartbeat as beats
from verl_hpc.launcher.restarts import SPENT_EXIT, Death, Ledger, from_exit, from_srun

REPO = Path(__file__).resolve().parents[2]
SEGV = """srun: error: node2: task 1: Segmentation fault
srun: launch/slurm: _step_signal: Terminating StepId=2.0
slurmstepd-node1: error: *** STEP 2.0 ON node1 CANCELLED AT 2026-11-29T08:53:38 ***
srun: error: node1: task 0: Terminated
srun: Force Terminated StepId=2.0
"""
EXIT3 = SEGV.replace("Segmentation fault", "Exited with exit code 3")
LAUNCH_FAILED = """srun: error: Task launch for StepId=6.0 failed on node node2: Communication connection failure
srun: error: Application launch failed: Communication connection failure
srun: Job step aborted: Waiting up to 7 seconds for job step to finish.
slurmstepd-node1: error: *** STEP 6.0 ON node1 CANCELLED AT 2026-11-29T09:05:11 ***
srun: error: node1: task 0: Killed
"""


def test_srun_report_gives_the_first_death_not_the_tasks_srun_terminated():
    assert from_srun(SEGV) == ([Death(1, "node2", "SIGSEGV", True)], [])
    assert from_srun(SEGV.replace("Segmentation fault", "Killed")) == ([Death(1, "node2", "SIGKILL", True)], [])
    # an error the rank reported: its code, and not a death (a relaunch would replay it)
    assert from_srun(EXIT3) == ([Death(1, "node2", "exit code 3", False)], [])
    assert from_srun(EXIT3.replace("code 3", "code 16"))[0][0].restartable  # the stage watchdog: a stall
    # a node whose slurmd is gone: the launch fails there; the tasks srun then kills are not the cause
    assert from_srun(LAUNCH_FAILED) == ([], ["node2"])
    assert from_srun("srun: error: Node failure on node2\n") == ([], ["node2"])
    deaths, _ = from_srun("srun: error: node3: tasks 4-5,7: Killed\n")
    assert [d.rank for d in deaths] == [4, 5, 7] and all(d.node == "node3" for d in deaths)


@pytest.mark.parametrize("code,how,restartable", [
    (-9, "SIGKILL", True), (137, "SIGKILL", True), (-11, "SIGSEGV", True), (-6, "SIGABRT", True),
    (16, "exit code 16: stalled outside collectives", True),
    (-15, "SIGTERM", False), (143, "SIGTERM", False), (-12, "SIGUSR2", False),  # stops asked for
    (1, "exit code 1", False), (2, "exit code 2", False), (19, "exit code 19", False)])
def test_what_counts_as_a_death(code, how, restartable):
    assert from_exit(3, code) == Death(3, "", how, restartable)


def died(rank=3, node="n2", how="SIGSEGV", step=41):
    return Death(rank, node, how, True, step)


def test_the_line_a_restart_prints_and_the_budget():
    ledger = Ledger(max_restarts=2, backoff_s=10)
    v = ledger.decide([died()], nodes=["n1", "n2"], needed=2, step=41)
    assert (v.action, v.attempt, v.wait_s, v.exclude) == ("restart", 1, 10.0, ())
    assert v.line(40) == "[restart] rank 3 on node n2 died (SIGSEGV) at step 41; restarted from step 40 (1 of 2)"
    assert v.line(None).endswith("restarted from the start (no checkpoint yet) (1 of 2)")
    assert v.line(None, known=False).endswith("restarted from the latest checkpoint (1 of 2)")
    v = ledger.decide([died(step=44)], nodes=["n1", "n2"], needed=2, step=44)
    assert (v.action, v.attempt, v.wait_s) == ("restart", 2, 20.0)  # the back-off doubles
    v = ledger.decide([died(step=45)], nodes=["n1", "n2"], needed=2, step=45)
    assert (v.action, v.exit_code) == ("stop", SPENT_EXIT)  # spent: one line, a code of its own, no loop
    assert v.line(44) == ("[restart] rank 3 on node n2 died (SIGSEGV) at step 45; not restarted: the 2 restart(s) "
                          "of slurm.max_restarts = 2 are spent; the job ends with its checkpoint of step 44")
    assert ledger.decide([died()], nodes=["n1", "n2"], needed=2).action == "stop"  # and stays spent


def test_back_off_is_capped_and_zero_means_none():
    ledger = Ledger(max_restarts=20, backoff_s=100)
    waits = [ledger.decide([died()]).wait_s for _ in range(5)]
    assert waits == [100, 200, 300, 300, 300]
    assert Ledger(max_restarts=1, backoff_s=0).decide([died()]).wait_s == 0


def test_an_error_a_rank_reported_is_not_restarted_and_keeps_its_code():
    ledger = Ledger(max_restarts=2)
    v = ledger.decide([from_exit(1, 2, "n1")], step=5, exit_code=2)
    assert (v.action, v.exit_code, ledger.restarts) == ("stop", 2, 0)
    assert v.line(4) == ("[restart] rank 1 on node n1 failed (exit code 2) at step 5; not restarted: an error the "
                         "rank reported, which a relaunch from the checkpoint would meet again; the job ends with "
                         "its checkpoint of step 4")
    # a death and its collateral (a peer's error on the closed connection): the death is the news
    v = ledger.decide([from_exit(0, 1), from_exit(1, -9)], step=5)
    assert v.action == "restart" and v.what == "rank 1 died (SIGKILL) at step 5"


def test_a_node_whose_ranks_died_twice_is_left_out_where_a_spare_takes_its_place():
    nodes = ["n1", "n2", "n3"]  # n1: the batch host, the spare while one is needed
    ledger = Ledger(max_restarts=5, spare_nodes=1, batch_host="n1")
    assert ledger.first_exclude(nodes, needed=2) == ["n1"]
    v = ledger.decide([died(node="n3")], nodes=nodes, needed=2, step=7)
    assert v.exclude == ("n1",) and v.left_out == ""  # once: the node stays
    v = ledger.decide([died(node="n3", step=9)], nodes=nodes, needed=2, step=9)
    assert v.exclude == ("n3",)  # twice: out, and the batch host takes its place
    assert v.line(8) == ("[restart] rank 3 on node n3 died (SIGSEGV) at step 9; node n3 left out (its ranks died "
                         "in two launches); the ranks run on n1, n2 now; restarted from step 8 (2 of 5)")
    # no spare left: a node that died twice more stays in (there is nothing to run on instead)
    ledger.decide([died(node="n2")], nodes=nodes, needed=2)
    v = ledger.decide([died(node="n2")], nodes=nodes, needed=2)
    assert v.action == "restart" and v.exclude == ("n3",)


def test_a_lost_node_goes_at_once_or_the_job_is_requeued():
    nodes = ["n1", "n2"]
    ledger = Ledger(max_restarts=2, spare_nodes=1, batch_host="n1")
    deaths, lost = from_srun(LAUNCH_FAILED.replace("node2", "n2"))
    v = ledger.decide(deaths, lost, nodes=nodes, needed=1)
    assert v.action == "restart" and v.exclude == ("n2",)
    assert "node n2 left out (lost); the ranks run on n1 now" in v.line(3)
    # no spare: the layout no longer fits; requeued as Slurm would on a node failure, else stopped
    for requeue, action in ((True, "requeue"), (False, "stop")):
        v = Ledger(max_restarts=2, requeue=requeue).decide([], ["n2"], nodes=nodes, needed=2, step=4)
        assert v.action == action
        assert "node(s) n2 lost and 1 node(s) left, the layout takes 2 (slurm.spare_nodes = 0)" in v.line(3)
    assert Ledger(2, requeue=True).decide([], ["n2"], nodes=nodes, needed=2).line(3).endswith(
        "requeued: it resumes from step 3 on a new allocation")


def test_heartbeats_say_which_rank_went_silent_by_content_not_clock(tmp_path, monkeypatch):
    now = [100.0]
    watch = heartbeat.Watch(str(tmp_path), clock=lambda: now[0])
    assert watch.silent() == [] and watch.poll_s() == 1.0  # nobody beats yet: nobody is watched
    # the rank's writer (runtime/heartbeat.py) and the supervisor's reader agree on the file
    monkeypatch.setattr(beats, "_state", dict(step=0, beats=0, path=beats.path_of(str(tmp_path), 0),
                                              host="h0", timeout=10.0))
    beats.beat()
    (tmp_path / "rank1").write_text("1 0 4242 h1 10\n")  # each beat carries its rank's timeout
    assert watch.silent() == [] and watch.poll_s() == 2.0
    beats.at_step(7)  # a step's start beats at once, with the step
    now[0] = 109.0
    assert watch.silent() == []
    now[0] = 115.0  # rank 0 beat at 109 (its step), rank 1 not since 100
    (quiet,) = watch.silent()
    assert quiet[0] == 1 and quiet[1].pid == 4242 and quiet[2] == 15.0
    assert watch.silent() == []  # reported once
    assert watch.step_of(0) == 7 and watch.last_step() == 7 and watch.step_of(1) is None
    assert heartbeat.read(str(tmp_path / "rank0")).timeout_s == 10.0
    assert beats.interval_for(300) == 30 and beats.interval_for(5) == 1.0 and beats.interval_for(0.1) == 0.2
    assert (beats.ENV, beats.JOB, beats.path_of("f", 3)) == (heartbeat.ENV, heartbeat.JOB, heartbeat.path_of("f", 3))


def test_the_batch_host_modules_are_standard_library_python_3_8():
    """The Slurm supervisor runs with the batch host's python3 (launcher/restart_loop.py)."""
    allowed = {"verl_hpc.launcher.heartbeat", "verl_hpc.launcher.restarts", "verl_hpc.launcher"}
    for name in ("restart_loop", "restarts", "heartbeat"):
        source = (REPO / "verl_hpc" / "launcher" / f"{name}.py").read_text()
        tree = ast.parse(source, feature_version=(3, 8))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for mod in mods:
                    assert mod in allowed or mod.split(".")[0] in sys.stdlib_module_names, (name, mod)
        assert "from __future__" not in source, name


def test_names_shared_with_the_ranks_agree():
    from verl_hpc.runtime import faults, watchdog

    assert restarts.ATTEMPT_ENV == faults.ATTEMPT_ENV and restarts.STALL_EXIT == watchdog.EXIT_CODE
    assert signal.SIGUSR2 in restarts.STOPS and signal.SIGKILL not in restarts.STOPS


def test_a_relaunch_resumes_from_what_this_job_saved_whatever_trainer_resume_says(tmp_path, monkeypatch):
    """trainer.resume=never or a path names the first launch's start; a relaunch (VERL_HPC_ATTEMPT
    > 0) takes `latest` where it is past that start, else the same start."""
    from types import SimpleNamespace

    import torch

    from verl_hpc.checkpoint import ShardedTensor, save_checkpoint
    from verl_hpc.checkpoint.checkpointer import Checkpointer, CheckpointOptions

    ours, other = tmp_path / "ours", tmp_path / "other"
    older = save_checkpoint(other, 5, [ShardedTensor("w", torch.ones(4))])

    def found(resume, attempt):
        monkeypatch.setenv(restarts.ATTEMPT_ENV, str(attempt))
        return Checkpointer(CheckpointOptions(dir=str(ours), resume=resume), SimpleNamespace(rank=0), engines={},
                            fmt="test").find()

    assert found("never", 1) is None  # nothing saved yet: a fresh start again
    assert found(str(older), 1) == older
    mine = save_checkpoint(ours, 3, [ShardedTensor("w", torch.ones(4))])
    assert found("never", 0) is None and found("never", 1) == mine
    assert found(str(older), 1) == older  # this job's step 3 is not past the start it was given (5)
    newer = save_checkpoint(ours, 7, [ShardedTensor("w", torch.ones(4))])
    assert found(str(older), 0) == older and found(str(older), 1) == newer
    assert found("auto", 0) == newer


@pytest.mark.parametrize("overrides,words", [
    (["slurm.spare_nodes=1", "slurm.max_restarts=0"],
     "slurm.spare_nodes = 1 with slurm.max_restarts = 0: a spare node only serves a restart"),
    (["slurm.spare_nodes=1", "placement.mode=split", "placement.rollout_partition=gpu", "placement.rollout_nodes=1"],
     "slurm.spare_nodes = 1 with placement.rollout_partition = 'gpu': a heterogeneous job's components have no spare"),
    (["trainer.heartbeat_timeout_s=600", "trainer.collective_timeout_s=600"],
     "trainer.heartbeat_timeout_s = 600 is not below trainer.collective_timeout_s = 600"),
    (["slurm.max_restarts=-1"], "slurm.max_restarts"),
])
def test_restart_settings_that_cannot_work_are_refused_at_load(overrides, words):
    from verl_hpc.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["model.path=/m", "data.train_files=[t.parquet]", "rollout.n=2", *overrides]), check_model=False)
    assert words in str(e.value), str(e.value)


def test_the_heartbeat_timeout_defaults_to_half_the_collective_timeout():
    from verl_hpc.config import load_config

    assert load_config(None, ["trainer.collective_timeout_s=90"]).trainer.heartbeat_timeout_s == 45
    assert load_config(None, ["trainer.heartbeat_timeout_s=0"]).trainer.heartbeat_timeout_s == 0


def test_locally_the_first_rank_to_die_decides_not_the_straggler_the_launcher_killed(tmp_path, capsys):
    """torch's launcher lists every rank that ended non-zero, the rank it SIGKILLed after its 30 s
    grace too (exit -9): a collective timeout on rank 0 with rank 1 wedged in Python is an error
    (not restarted); rank 1 killed first, rank 0 failing on the closed connection, is a death."""
    from types import SimpleNamespace

    from verl_hpc.launcher.local_restarts import LocalRestarts

    failures = {0: SimpleNamespace(exitcode=19), 1: SimpleNamespace(exitcode=-9)}
    plan = SimpleNamespace(max_restarts=2, restart_backoff_s=0, log_dir=tmp_path)
    running = SimpleNamespace(signum=None)
    assert LocalRestarts(plan).after(failures, running, order=[0, 1]).action == "stop"
    v = LocalRestarts(plan).after(failures, running, order=[1, 0])
    assert v.action == "restart" and v.what == "rank 1 died (SIGKILL)"
    assert LocalRestarts(plan).after(failures, SimpleNamespace(signum=15), order=[1, 0]) is None  # a stop
    assert capsys.readouterr().out.splitlines()[-1] == \
        "[restart] rank 1 died (SIGKILL); restarted from the start (no checkpoint yet) (1 of 2)"
