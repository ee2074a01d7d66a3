"""verl_hpc.runtime.local_ranks.wait_all: one deadline for every rank, cut short by the first that
fails, wherever it sits in the list (a rank waiting on the failed one in a collective would
otherwise hold the caller to the whole deadline)."""
import subprocess
import time

from verl_hpc.runtime import local_ranks
from verl_hpc.runtime.local_ranks import wait_all


def ranks(*scripts):
    return [subprocess.Popen(["sh", "-c", s]) for s in scripts]


def test_all_ranks_ending_well_is_no_failure():
    assert wait_all(ranks("exit 0", "sleep 0.3; exit 0"), timeout_s=60) is False


def test_a_later_rank_failing_ends_the_wait_for_an_earlier_one(monkeypatch):
    monkeypatch.setattr(local_ranks, "FAILED_GRACE_S", 1.0)
    procs = ranks("sleep 300", "sleep 0.2; exit 3", "sleep 300")
    t0 = time.monotonic()
    assert wait_all(procs, timeout_s=120) is True
    assert time.monotonic() - t0 < 30  # the grace after the failure, not the 120 s deadline
    assert procs[1].returncode == 3
    assert procs[0].returncode < 0 and procs[2].returncode < 0  # killed, and reaped


def test_the_others_get_the_grace_to_end_on_their_own(monkeypatch):
    monkeypatch.setattr(local_ranks, "FAILED_GRACE_S", 30.0)
    procs = ranks("sleep 0.5; exit 1", "exit 2")  # rank 0 ends with its own error after rank 1's
    assert wait_all(procs, timeout_s=120) is True
    assert [p.returncode for p in procs] == [1, 2]


def test_a_late_rank_is_killed_at_the_deadline():
    procs = ranks("exit 0", "sleep 300")
    t0 = time.monotonic()
    assert wait_all(procs, timeout_s=0.5) is True
    assert time.monotonic() - t0 < 30 and procs[1].returncode < 0
