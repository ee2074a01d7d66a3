"""Elastic rollout workers for real (docs/elastic.md): a split run of 1 rollout rank + 1 training
rank on this machine takes rollout workers, each a process of its own started by the user's command,
that join mid-run; one leaves on SIGTERM (scancel) and one is SIGKILLed while it generates; a third
is a straggler whose groups are re-dispatched. Training goes on, no token is more than k versions
old, and the run trains exactly the prompts of its data stream, in order: nothing lost, nothing
twice. A worker pointed at the finished run exits with one line. A worker SIGKILLed in its weight
fetch holds no other worker, and its Slurm requeue joins again."""
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from faults import env
from jobs import REPO, data_overrides, logs

SPLIT_DEMO = "configs/demo_rl_split.yaml"  # 1 rollout rank of 2, k = 1
STEPS, PROMPTS = 40, 4
GROUP_DELAY_S = 0.25  # per prompt group, the run's own rollout rank and the workers alike


def job_args(root, out):
    return [f"model.path={root}/model", *data_overrides(root), f"trainer.total_steps={STEPS}", "trainer.val_every=0",
            f"data.train_batch_size={PROMPTS}", "rollout.n=2", f"actor.ppo_mini_batch_size={PROMPTS}",
            "actor.micro_batch_size=8", "rollout.engine=hf", "slurm.cpus_per_task=1", "checkpoint.save_every=0",
            "tracking.backends=[jsonl]", "tracking.plots=false", "placement.elastic.enable=true",
            "placement.elastic.heartbeat_timeout_s=2", "placement.elastic.straggler_deadline_s=6",
            "placement.elastic.groups_per_lease=1", f"trainer.output_dir={out}", f"slurm.log_dir={out}/logs/%j"]


def start_worker(out, name, delay, log=None, restart=0, **faults):
    """Worker `name` (its log: `log` or its name, .log); restart: its SLURM_RESTART_COUNT (a requeue)."""
    log = open(out.parent / f"{log or name}.log", "w")
    cmd = [sys.executable, "-m", "verl_hpc.submit", "--join", str(out), "--local", "rollout.engine=hf"]
    e = env(elastic_worker_group_delay_s=delay, **faults)
    e.update(VERL_HPC_LOGLEVEL="INFO", OMP_NUM_THREADS="1", SLURM_JOB_ID=name)  # the worker's name in the pool
    if restart:
        e["SLURM_RESTART_COUNT"] = str(restart)
    return subprocess.Popen(cmd, cwd=REPO, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def generated(out, name, more_than=0):
    return groups_done(out, name) > more_than


def groups_done(out, name):
    path = out.parent / f"{name}.log"
    return path.read_text().count("group(s) done") if path.exists() else 0


@pytest.mark.long  # a soak run: workers join, leave, die and straggle over a whole run (make test-long)
def test_workers_join_leave_die_and_straggle_and_every_prompt_is_trained_once(tiny_assets, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "verl_hpc.submit", SPLIT_DEMO, "--local", "slurm.tasks_per_node=2",
           *job_args(tiny_assets, out)]
    run = subprocess.Popen(cmd, cwd=REPO, env=env(rollout_group_delay_s=GROUP_DELAY_S), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers = {}
    try:
        wait_for(lambda: (out / "elastic" / "rendezvous.json").exists() or run.poll() is not None, "no rendezvous")
        workers = {"calm": start_worker(out, "calm", GROUP_DELAY_S), "killed": start_worker(out, "killed", GROUP_DELAY_S),
                   "slow": start_worker(out, "slow", 12.0)}  # a straggler: its groups pass the 6 s deadline
        for name in ("calm", "killed"):
            wait_for(lambda: generated(out, name) or run.poll() is not None, f"worker {name} never finished a group")
        time.sleep(GROUP_DELAY_S / 2)  # the killed one is in its next group, most likely
        os.killpg(workers["killed"].pid, signal.SIGKILL)
        workers["calm"].send_signal(signal.SIGTERM)
        assert workers["calm"].wait(timeout=60) == 0
        # the run is still going when the killed worker's silence is noticed (2 s): it is reaped
        wait_for(lambda: "killed" in _left(out) or run.poll() is not None, "the killed worker was never reaped")
        assert run.poll() is None, "the run ended before the killed worker was reaped: give it more steps"
        stdout, stderr = run.communicate(timeout=600)
        # the straggler leaves by itself once its group in hand is done and it sees the run stopped
        wait_for(lambda: workers["slow"].poll() is not None, "the straggler must leave when the run stops", timeout=90)
    finally:
        for p in [run, *workers.values()]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    proc = subprocess.CompletedProcess(cmd, run.returncode, stdout, stderr)
    assert run.returncode == 0, logs(proc, out)
    summary = json.loads((out / "rl_summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    # nothing lost, nothing twice: the data stream's prompts, in order
    assert collections.Counter(summary["trained_prompt_ids"]) == collections.Counter(_stream(tiny_assets, out))
    assert summary["trained_prompt_ids"] == _stream(tiny_assets, out)
    assert max(r["async/staleness_max"] for r in rows) <= 1 and all(r["async/dropped_groups"] == 0 for r in rows)

    last = rows[-1]
    assert last["elastic/joins"] == 3 and last["elastic/samples/workers"] > 0, last
    assert last["elastic/reaped"] >= 1  # the killed worker, silent past the heartbeat timeout
    assert last["elastic/redispatched"] > 0  # the straggler's groups, and the killed worker's after its lease aged
    # every trained sample was accepted once; the rollout side may already have filled the batches it
    # opened ahead of the last step (k = 1: up to 2) by the time that step's row is written
    made = last["elastic/samples/fixed"] + last["elastic/samples/workers"]
    assert made in {(STEPS + ahead) * PROMPTS * 2 for ahead in range(3)}, made
    events = [json.loads(x) for x in (out / "elastic" / "events.jsonl").read_text().splitlines()]
    leaves = {e["worker"]: e for e in events if e["kind"] == "leave"}
    assert leaves["calm"]["reason"].startswith("said goodbye: stopped by SIGTERM") and leaves["calm"]["samples"] > 0
    assert leaves["killed"]["reason"].startswith("no heartbeat for") and leaves["killed"]["samples"] > 0
    assert {e["worker"] for e in events if e["kind"] == "weights"} == {"calm", "killed", "slow"}
    assert workers["slow"].returncode == 0, (workers["slow"].returncode, (out.parent / "slow.log").read_text()[-3000:])

    # a worker pointed at the finished run: one line, exit 30
    late = subprocess.run([sys.executable, "-m", "verl_hpc.submit", "--join", str(out), "--local"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert late.returncode == 30 and late.stderr.strip().startswith(f"error: the run in {out} has ended (stopped at")


def test_a_worker_killed_in_its_weight_fetch_stalls_no_other_and_its_requeue_joins_again(tiny_assets, tmp_path):
    """Issue 76 items 5 and 6, live. Worker `killed` stops inside its first weight fetch (its pair
    requested, its side not formed) and is SIGKILLed there: worker `calm` keeps generating (on one
    serving thread the server waited for the dead side for the timeout, and `calm`, asking for
    newer weights, waited with it). Then Slurm's requeue of `killed` (its job id, restart 1) joins
    again and generates."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "verl_hpc.submit", SPLIT_DEMO, "--local", "slurm.tasks_per_node=2",
           *job_args(tiny_assets, out), "trainer.total_steps=1000",  # it runs until the test ends it
           # calm must stay in the pool throughout: 2 s of silence under a loaded machine's scheduling
           # took it out once (the killed worker leaves by its requeue's join or by this timeout)
           "placement.elastic.heartbeat_timeout_s=10", "placement.elastic.straggler_deadline_s=20"]
    run_log = tmp_path / "run.log"  # a file, not a pipe: nothing reads the run's output until it ends
    run = subprocess.Popen(cmd, cwd=REPO, env=env(rollout_group_delay_s=GROUP_DELAY_S), stdout=open(run_log, "w"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    workers = []
    stalled = lambda: "stalls in its weight fetch" in (out.parent / "killed.log").read_text()  # noqa: E731
    try:
        wait_for(lambda: (out / "elastic" / "rendezvous.json").exists() or run.poll() is not None, "no rendezvous")
        workers += [start_worker(out, "calm", GROUP_DELAY_S),  # both start at once: one start-up's wait
                    start_worker(out, "killed", GROUP_DELAY_S, elastic_worker_stalls_in_fetch=True)]
        wait_for(lambda: stalled() or run.poll() is not None, "killed never stalled in its weight fetch")
        wait_for(lambda: generated(out, "calm") or run.poll() is not None,
                 "calm generated nothing while killed stalled in its weight fetch")
        time.sleep(1.0)  # calm's next weight requests come while killed's pair is still pending
        os.killpg(workers[1].pid, signal.SIGKILL)
        before = groups_done(out, "calm")
        workers.append(start_worker(out, "killed", GROUP_DELAY_S, log="killed.requeued", restart=1))
        # the server's timeout is trainer.collective_timeout_s (600 s): a held fetch would hold calm for that
        wait_for(lambda: generated(out, "calm", before + 3) or run.poll() is not None,
                 "calm stopped generating once killed died in its fetch", timeout=60)
        wait_for(lambda: generated(out, "killed.requeued") or run.poll() is not None,
                 "the requeued worker never generated", timeout=90)
        assert run.poll() is None, run_log.read_text()[-5000:]
        assert workers[0].poll() is None, (out.parent / "calm.log").read_text()[-3000:]
    finally:
        for p in [run, *workers]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    events = [json.loads(x) for x in (out / "elastic" / "events.jsonl").read_text().splitlines()]
    joins = [(e["worker"], e["restart"], e["rejoin"]) for e in events if e["kind"] == "join"]
    assert sorted(joins) == [("calm", 0, False), ("killed", 0, False), ("killed", 1, True)], joins
    # the dead run of killed left the pool: reaped (silent 10 s), or replaced by its requeue if that came first
    gone = [e["reason"] for e in events if e["kind"] == "leave" and e["worker"] == "killed"]
    assert len(gone) == 1 and (gone[0].startswith("no heartbeat") or gone[0] == "replaced by its requeue (restart 1)")
    assert "calm" not in {e["worker"] for e in events if e["kind"] == "leave"}


def _left(out):
    f = out / "elastic" / "events.jsonl"
    return {e["worker"] for e in map(json.loads, f.read_text().splitlines()) if e["kind"] == "leave"} if f.exists() else set()


def _stream(root, out):
    from verl_hpc.config import load_config
    from verl_hpc.data import PromptLoader
    from verl_hpc.trainer.roles import load_tokenizer

    cfg = load_config(REPO / SPLIT_DEMO, job_args(root, out))
    loader = PromptLoader.from_config(cfg.data, load_tokenizer(cfg), cfg.data.wrap_plain_text)
    return [i for _ in range(STEPS) for i in loader.next_batch().ids]


@pytest.mark.long  # a chain of launches: preempted, resumed, new workers (make test-long)
def test_a_preempted_run_with_workers_attached_resumes_and_takes_new_workers(tiny_assets, tmp_path):
    """The run stopped by SIGTERM (as scancel or a preemption stops it: the ranks finish the step,
    checkpoint and exit) once its worker has generated: the worker leaves by itself (exit 0), the
    resubmitted run resumes from the checkpoint (the book's finished samples in it) under a new epoch
    and takes a new worker; the two launches train exactly the data stream's prompts, in order."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "verl_hpc.submit", SPLIT_DEMO, "--local", "slurm.tasks_per_node=2",
           *job_args(tiny_assets, out)]
    rdv = out / "elastic" / "rendezvous.json"
    trained, epochs, stopped_at = [], [], None
    for launch in range(2):
        before = rdv.read_text() if rdv.exists() else ""
        run = subprocess.Popen(cmd, cwd=REPO, env=env(rollout_group_delay_s=GROUP_DELAY_S), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        name, worker = f"worker{launch}", None
        try:
            wait_for(lambda: (rdv.exists() and rdv.read_text() != before and '"running"' in rdv.read_text())
                     or run.poll() is not None, "no new rendezvous")
            epochs.append(json.loads(rdv.read_text())["epoch"])
            worker = start_worker(out, name, GROUP_DELAY_S)
            wait_for(lambda: generated(out, name) or run.poll() is not None, f"{name} never finished a group")
            if launch == 0:
                run.send_signal(signal.SIGTERM)  # the submitter passes it on: step, checkpoint, exit
            stdout, stderr = run.communicate(timeout=600)
            assert worker.wait(timeout=60) == 0, (out.parent / f"{name}.log").read_text()[-3000:]
        finally:
            for p in (run, worker):
                if p is not None and p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        proc = subprocess.CompletedProcess(cmd, run.returncode, stdout, stderr)
        summary = json.loads((out / "rl_summary.json").read_text())
        if launch == 0:
            assert run.returncode == 143 and summary["stopped"] == "preempted", logs(proc, out)
            stopped_at = summary["steps"]
            assert 0 < stopped_at < STEPS, summary
        else:
            assert run.returncode == 0, logs(proc, out)
            assert summary["resumed_from"] == stopped_at and summary["steps"] == STEPS, summary
        trained += summary["trained_prompt_ids"]
        assert "group(s) done" in (out.parent / f"{name}.log").read_text(), f"{name} never generated"
    assert epochs[0] != epochs[1]
    assert trained == _stream(tiny_assets, out)


@pytest.mark.long  # a second elastic launch (make test-long); make test covers the minimum-pool rule in
# tests/unit/trainer/test_elastic_ledger.py and an elastic job's workers in the test above
def test_a_pool_below_its_minimum_for_too_long_stops_the_run_naming_it(tiny_assets, tmp_path):
    out = tmp_path / "run"
    args = [*job_args(tiny_assets, out), "placement.elastic.min_rollout_workers=1", "placement.elastic.lost_timeout_s=5"]
    proc = subprocess.run([sys.executable, "-m", "verl_hpc.submit", SPLIT_DEMO, "--local", "slurm.tasks_per_node=2",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    # the rollout leader's line (the training rank quotes it too, unless the launcher ends it first);
    # how long it had been below is when the leader looked: 5 s quiet, 12 s seen on a loaded machine
    line = re.compile(r"error: the rollout pool has had 0 worker\(s\), fewer than placement\.elastic\."
                      r"min_rollout_workers = 1, for (\d+) s \(placement\.elastic\.lost_timeout_s = 5\); "
                      r"workers lost: none had joined")
    found = line.search(proc.stdout + proc.stderr)
    assert proc.returncode != 0 and found and int(found.group(1)) >= 5, logs(proc, out)
    assert json.loads((out / "elastic" / "rendezvous.json").read_text())["status"] == "failed"
