"""Elastic rollout workers on the dev Slurm cluster (docs/elastic.md): a split run (1 rollout rank + 1
training rank) submitted with `python -m verl_hpc.submit`, then two rollout workers submitted as a job
array of their own with `python -m verl_hpc.submit --join RUN_DIR --workers 2`. They join mid-run and
the run's samples/s rises; one array task is `scancel`led (SIGTERM: it says goodbye) and the other's
process is killed with SIGKILL while it generates (it stops beating and is reaped); training goes on, no token is
more than k versions old, and the run trains exactly its data stream's prompts, in order. A worker job
that Slurm requeues joins the run again."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from faults import env
from jobs import REPO, data_overrides

SPLIT_DEMO = "configs/demo_rl_split.yaml"  # 1 rollout rank of 2, k = 1
STEPS, PROMPTS, N = 40, 4, 2
GROUP_DELAY_S = 0.25  # per prompt group, the run's own rollout rank and the workers alike


@pytest.fixture(scope="module", autouse=True)
def cluster_is_up():
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and {"idle", "mixed", "allocated"} & set(r.stdout.split()), (
        f"dev cluster not usable (sinfo: {r.stdout!r} {r.stderr!r}); run slurm/devcluster/start.sh")


def rows(out):
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip().endswith("}")]


def events(out):
    f = out / "elastic" / "events.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def wait_for(predicate, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def samples_per_s(rs):
    """Trained samples per second over metrics rows (each step trains PROMPTS x N samples)."""
    return (len(rs) - 1) * PROMPTS * N / (rs[-1]["time"] - rs[0]["time"])


@pytest.mark.long  # worker jobs join and leave a running run, each a Slurm job (make test-long)
def test_worker_jobs_join_a_running_run_and_leave_it_without_ending_it(tiny_assets, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = [f"model.path={tiny_assets}/model", *data_overrides(tiny_assets), f"trainer.total_steps={STEPS}",
            "trainer.val_every=0", f"data.train_batch_size={PROMPTS}", f"rollout.n={N}",
            f"actor.ppo_mini_batch_size={PROMPTS}", "actor.micro_batch_size=8", "rollout.engine=hf",
            "checkpoint.save_every=0", "tracking.backends=[jsonl]", "tracking.plots=false", "slurm.time_min=15",
            "placement.elastic.enable=true", "placement.elastic.heartbeat_timeout_s=5",
            "placement.elastic.straggler_deadline_s=20", "placement.elastic.groups_per_lease=1",
            f"trainer.output_dir={out}", f"slurm.log_dir={logs}/%j"]
    faults = env(rollout_group_delay_s=GROUP_DELAY_S, elastic_worker_group_delay_s=GROUP_DELAY_S)
    run = subprocess.Popen([sys.executable, "-m", "verl_hpc.submit", SPLIT_DEMO, *args], cwd=REPO, env=faults,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    array = None
    try:
        wait_for(lambda: len(rows(out)) >= 4 or run.poll() is not None, "the run never logged 4 steps")
        joined = subprocess.run([sys.executable, "-m", "verl_hpc.submit", "--join", str(out), "--workers", "2",
                                 "rollout.engine=hf", "slurm.time_min=10"], cwd=REPO, env=faults,
                                capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        array = re.search(r"job (\d+) \(array of 2\)", joined.stdout).group(1)
        wait_for(lambda: len({e["worker"] for e in events(out) if e["kind"] == "weights"}) == 2 or run.poll() is not None,
                 "the two workers never loaded their weights")
        before = [r for r in rows(out) if r.get("elastic/pool_size", 0) == 0]
        wait_for(lambda: rows(out)[-1].get("elastic/samples/workers", 0) >= 8 or run.poll() is not None,
                 "the workers never delivered")
        start = len(rows(out))
        wait_for(lambda: len(rows(out)) >= start + 5 or run.poll() is not None, "no steps with the workers")
        after = rows(out)[start - 1:]
        workers = sorted({e["worker"] for e in events(out) if e["kind"] == "join"})
        assert workers == [f"{array}_0", f"{array}_1"], workers
        subprocess.run(["scancel", f"{array}_0"], check=True, timeout=30)  # SIGTERM: a goodbye
        # SIGKILL to the worker process itself (the OOM killer, a lost node): scancel's KILL would end
        # the job, and Slurm would SIGTERM the worker first
        pid = next(e["pid"] for e in events(out) if e["kind"] == "join" and e["worker"] == f"{array}_1")
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
        if array is not None:
            subprocess.run(["scancel", array], timeout=30)
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    rs = rows(out)
    assert [r["step"] for r in rs] == list(range(1, STEPS + 1))
    summary = json.loads((out / "rl_summary.json").read_text())
    assert summary["trained_prompt_ids"] == _stream(args)  # nothing lost, nothing twice
    assert max(r["async/staleness_max"] for r in rs) <= 1 and all(r["async/dropped_groups"] == 0 for r in rs)
    leaves = {e["worker"]: e["reason"] for e in events(out) if e["kind"] == "leave"}
    assert leaves[f"{array}_0"].startswith("said goodbye: stopped by SIGTERM"), leaves
    assert leaves[f"{array}_1"].startswith("no heartbeat for"), leaves
    rate_before, rate_after = samples_per_s(before), samples_per_s(after)
    print(f"samples/s: {rate_before:.2f} before the workers joined, {rate_after:.2f} with them "
          f"({rate_after / rate_before:.2f}x)")
    assert rate_after > 1.3 * rate_before, (rate_before, rate_after)


@pytest.mark.long  # a second elastic run through Slurm (make test-long); make test covers a requeued
# worker joining again with local ranks (tests/dist/trainer/test_elastic_job.py) and Slurm's requeue
# rule in tests/unit/test_requeue_rule.py
def test_a_worker_job_requeued_by_slurm_joins_again(tiny_assets, tmp_path):
    """`scontrol requeue` of a worker's array task (as Slurm does when its node fails): the task comes
    back under its job id with SLURM_RESTART_COUNT 1, and the run takes it as a new member, which loads
    the weights and generates (issue 76 item 6: it was refused as "known to have left")."""
    out = tmp_path / "run"
    args = [f"model.path={tiny_assets}/model", *data_overrides(tiny_assets), "trainer.total_steps=1000",
            "trainer.val_every=0", f"data.train_batch_size={PROMPTS}", f"rollout.n={N}",
            f"actor.ppo_mini_batch_size={PROMPTS}", "actor.micro_batch_size=8", "rollout.engine=hf",
            "checkpoint.save_every=0", "tracking.backends=[jsonl]", "tracking.plots=false",
            "slurm.time_min=15", "placement.elastic.enable=true",
            "placement.elastic.heartbeat_timeout_s=5", "placement.elastic.straggler_deadline_s=20",
            "placement.elastic.groups_per_lease=1", f"trainer.output_dir={out}", f"slurm.log_dir={out}/logs/%j"]
    faults = env(rollout_group_delay_s=GROUP_DELAY_S, elastic_worker_group_delay_s=GROUP_DELAY_S)
    # the run is a Slurm job too: the dev cluster's nodes are network namespaces of their own, where
    # a run started here with --local (its store on this machine's loopback) cannot be reached
    run = subprocess.Popen([sys.executable, "-m", "verl_hpc.submit", SPLIT_DEMO, *args], cwd=REPO,
                           env=faults, stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT,
                           start_new_session=True)
    array = run_job = None
    try:
        wait_for(lambda: re.search(r"\[submit\] job (\d+) submitted", (tmp_path / "run.log").read_text())
                 or run.poll() is not None, "the run was never submitted", timeout=120)
        run_job = re.search(r"\[submit\] job (\d+) submitted", (tmp_path / "run.log").read_text()).group(1)
        wait_for(lambda: (out / "elastic" / "rendezvous.json").exists() or run.poll() is not None, "no rendezvous")
        joined = subprocess.run([sys.executable, "-m", "verl_hpc.submit", "--join", str(out), "--workers", "1",
                                 "rollout.engine=hf", "slurm.time_min=10"], cwd=REPO, env=faults,
                                capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        array = re.search(r"job (\d+) \(array of 1\)", joined.stdout).group(1)
        loads = lambda: [e for e in events(out) if e["kind"] == "weights"]  # noqa: E731
        wait_for(lambda: loads() or run.poll() is not None, "the worker never loaded its weights")
        task = loads()[0]["worker"]  # its Slurm job (and array task, where Slurm made one)
        job = next(e["job"] for e in events(out) if e["kind"] == "join")
        assert task.split("_")[0] == array and job, (task, job)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        # Slurm holds a requeued job for about 2 minutes (BeginTime) before it may start again; what the
        # test is about starts after that: waive the wait once the job is back in the queue
        wait_for(lambda: _state(job) == "PENDING", "the requeued job never went back to the queue", timeout=60)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)
        wait_for(lambda: len(loads()) == 2 or run.poll() is not None, "the requeued worker never loaded its weights")
        assert run.poll() is None, (tmp_path / "run.log").read_text()[-5000:]
    finally:
        for job_id in (array, run_job):
            if job_id is not None:
                subprocess.run(["scancel", job_id], timeout=30)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    joins = [(e["worker"], e["restart"], e["rejoin"]) for e in events(out) if e["kind"] == "join"]
    assert joins == [(task, 0, False), (task, 1, True)], joins
    first_run = [e["reason"] for e in events(out) if e["kind"] == "leave"][0]  # (the test's scancel ends the second)
    # requeue stops the task with SIGTERM (a goodbye); were the requeue faster than that, it replaces it
    assert first_run.startswith("said goodbye") or first_run.startswith("replaced by its requeue"), first_run


def _state(job):
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return r.stdout.strip()


def _stream(args):
    from verl_hpc.config import load_config
    from verl_hpc.data import PromptLoader
    from verl_hpc.trainer.roles import load_tokenizer

    cfg = load_config(REPO / SPLIT_DEMO, args)
    loader = PromptLoader.from_config(cfg.data, load_tokenizer(cfg), cfg.data.wrap_plain_text)
    return [i for _ in range(STEPS) for i in loader.next_batch().ids]
