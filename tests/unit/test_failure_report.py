"""How the submitter names failed ranks (issue 29): in a split job each rank with its group, `rank 0
(rollout)` / `rank 1 (train)`, on the local launcher and from srun's report; a death by signal with the
signal's name. And a weight broadcast whose peer died fails with one line naming the peer."""
import datetime
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from verl_hpc.launcher import slurm
from verl_hpc.launcher.local import report_failures
from verl_hpc.launcher.plan import exit_words
from verl_hpc.runtime.launch_env import LaunchEnv
from verl_hpc.runtime.split import GroupLostError, Mailbox, SplitWorld


def rank_logs(log_dir: Path, texts: dict) -> None:
    """The local launcher's per-rank logs, written in the order given (the first is oldest)."""
    for i, (rank, text) in enumerate(texts.items()):
        log = log_dir / "run1" / "attempt_0" / str(rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(text)
        os.utime(log, ns=(10**18 + i * 10**9,) * 2)


def report_lines(capsys) -> list:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("[submit]   ")]


def test_local_report_names_the_group_of_each_rank_of_a_split_job(tmp_path, capsys):
    rank_logs(tmp_path, {0: "vllm generating\n", 1: "error: rank 1: training rank 0: lost the rollout group\n"})
    report_failures({0: SimpleNamespace(exitcode=-9), 1: SimpleNamespace(exitcode=25)}, tmp_path, rollout_ranks=1)
    lines = report_lines(capsys)
    assert lines[0].startswith("[submit]   rank 0 (rollout) exited with code -9 (SIGKILL) (failed first); log: "), lines
    assert lines[1].startswith("[submit]   rank 1 (train) exited with code 25; log: "), lines
    assert lines[2] == "[submit]     error: rank 1: training rank 0: lost the rollout group", lines


def test_local_report_of_a_colocated_job_names_no_group(tmp_path, capsys):
    rank_logs(tmp_path, {1: "error: rank 1: boom\n", 0: "stopped\n"})
    report_failures({0: SimpleNamespace(exitcode=-15), 1: SimpleNamespace(exitcode=3)}, tmp_path)
    lines = report_lines(capsys)
    assert lines[0].startswith("[submit]   rank 1 exited with code 3 (failed first); log: "), lines
    assert lines[2].startswith("[submit]   rank 0 exited with code -15 (SIGTERM); log: "), lines


@pytest.mark.parametrize("code, words", [(-9, "-9 (SIGKILL)"), (137, "137 (128 + SIGKILL)"), (25, "25"),
                                         (1, "1"), (-40, "-40")])
def test_exit_code_words(code, words):
    assert exit_words(code) == words


class FakeSlurmJob:
    """What slurm.wait reads of a submitit job that sacct says FAILED."""

    def __init__(self, folder: Path):
        self.job_id, self.state = "77", "FAILED"
        self.paths = SimpleNamespace(folder=folder, stdout=folder / "77_0_log.out", stderr=folder / "77_0_log.err")

    def done(self) -> bool:
        return True

    def get_info(self, mode=None):
        return {"State": "FAILED"}


def test_slurm_report_names_the_group_of_each_rank_of_a_split_job(tmp_path, capsys):
    # srun's own lines in the batch log (submitit's task 0 log), and rank 1's `error:` line
    (tmp_path / "77_0_log.err").write_text("srun: error: n1: task 0: Killed\n"
                                           "srun: error: n2: tasks 1-2: Exited with exit code 25\n")
    (tmp_path / "77_1_log.err").write_text("error: rank 1: training rank 0: lost the rollout group\n")
    assert slurm.wait(FakeSlurmJob(tmp_path), poll_s=0, rollout_ranks=1) == 1
    lines = report_lines(capsys)
    assert lines[0].startswith("[submit]   rank 0 (rollout): Killed (node n1); log: "), lines
    assert lines[1].startswith("[submit]   rank 1 (train): error: rank 1: training rank 0: lost the rollout group "
                               "(node n2); log: "), lines
    assert lines[2].startswith("[submit]   rank 2 (train): Exited with exit code 25 (node n2); log: "), lines
    assert slurm.wait(FakeSlurmJob(tmp_path), poll_s=0) == 1  # colocated: as before
    assert report_lines(capsys)[0].startswith("[submit]   rank 0: Killed (node n1); log: ")


TRAINER = textwrap.dedent("""
    import datetime, sys, time
    import torch, torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bridge/weights/", store), 0, 2, datetime.timedelta(seconds=120))
    opts = dist.BroadcastOptions()
    group.broadcast([torch.arange(8, dtype=torch.uint8)], opts).wait()
    time.sleep(600)  # alive until the test kills it
""")


def test_a_weight_broadcast_whose_trainer_died_names_it(tmp_path):
    """The rollout rank (global 0, serving the store) gets one bucket, then the first training rank
    (global 1, a real process) is killed: the next broadcast fails at once, naming that rank."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(store.port)])
    try:
        env = LaunchEnv("torchrun", 0, 1, 0, 1, 0, "127.0.0.1", store.port - 1)
        world = SplitWorld(role="rollout", global_rank=0, global_world=2, rollout_ranks=1, local_env=env,
                           store=store, mailbox=Mailbox(store, "rollout rank 0", 120.0), timeout_s=120.0,
                           backend="gloo")
        bucket = torch.zeros(8, dtype=torch.uint8)
        world.broadcast(bucket)
        assert bucket.tolist() == list(range(8))
        trainer.kill()
        trainer.wait(timeout=30)
        t0 = time.monotonic()
        with pytest.raises(GroupLostError) as err:
            world.broadcast(bucket)
        assert time.monotonic() - t0 < 10  # a dead peer, not the timeout
    finally:
        trainer.kill()
    message = str(err.value)
    assert message.startswith("rollout rank 0 (global 0): the weight broadcast failed ("), message
    assert message.endswith("the first training rank (global rank 1) died or is stuck: see its log"), message
    assert "\n" not in message
