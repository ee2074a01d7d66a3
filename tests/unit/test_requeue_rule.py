"""The stop-or-requeue rule after a signal (runtime/requeue.py, docs/signals.md): the warning
signal requeues, SIGTERM requeues only when Slurm is preempting the job, scancel never requeues."""
import os
import signal

import pytest

from verl_hpc.runtime.requeue import decide, parse_show_job
from verl_hpc.runtime.signals import PreemptionFlag


# `scontrol show job -o` lines as Slurm 22.05 prints them (trimmed to the fields around ours)
RUNNING = ("JobId=41 JobName=verl_hpc UserId=root(0) Priority=1 JobState=RUNNING Reason=None "
           "Requeue=1 Restarts=0 RunTime=00:00:31 PreemptEligibleTime=2026-11-22T12:00:00 PreemptTime=None "
           "Partition=debug Command=/tmp/x y")
CANCELLED = RUNNING.replace("JobState=RUNNING", "JobState=CANCELLED")
PREEMPTING = RUNNING.replace("PreemptTime=None", "PreemptTime=2026-11-22T12:00:31")
TIMEOUT = RUNNING.replace("JobState=RUNNING", "JobState=TIMEOUT")


def test_parse_show_job_reads_fields():
    info = parse_show_job(PREEMPTING)
    assert info["JobState"] == "RUNNING" and info["PreemptTime"] == "2026-11-22T12:00:31"
    assert info["Requeue"] == "1"


@pytest.mark.parametrize("signal_name,line,requeue,words", [
    ("SIGUSR2", RUNNING, True, "warning signal"),
    ("SIGUSR2", "", True, "warning signal"),             # no need to ask Slurm
    ("SIGTERM", CANCELLED, False, "JobState=CANCELLED"),  # scancel: stays ended
    ("SIGTERM", RUNNING, False, "without preemption"),
    ("SIGTERM", TIMEOUT, False, "JobState=TIMEOUT"),
    ("SIGTERM", PREEMPTING, True, "preempting"),
    ("SIGTERM", RUNNING.replace("RUNNING", "PREEMPTED"), True, "preempting"),
    ("SIGTERM", "", False, "did not say"),              # Slurm did not answer: stop, never requeue
])
def test_decide(signal_name, line, requeue, words):
    d = decide(signal_name, parse_show_job(line))
    assert d.requeue is requeue and words in d.why, d


def test_decide_respects_slurm_requeue_false():
    d = decide("SIGUSR2", parse_show_job(PREEMPTING), requeue_enabled=False)
    assert not d.requeue and d.why == "slurm.requeue=false"


def test_warning_signal_wins_over_sigterm():
    flag = PreemptionFlag().install([signal.SIGUSR2, signal.SIGTERM])
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.signal_name == "SIGTERM" and flag.agreed() and flag.agreed_signal == "SIGTERM"
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.signal_name == "SIGUSR2" and flag.agreed() and flag.agreed_signal == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
