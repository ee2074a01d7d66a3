"""Split placement's protocol when one group leaves, in one process: the training leader's side
(AsyncLink and its weight server thread) and the rollout leader's (RolloutWorker) on two threads,
over a real TCP store and a real gloo weights group, with a fake engine and a fake actor.

A stop the trainer decided must reach a rollout rank at once wherever it waits on the trainer (its
go, a weight manifest, a version a generation request needs), and a rollout group leaving on an
error must reach a training rank at once: a wait that misses it sits out the whole timeout
(TIMEOUT_S here) and ends the job as a failure instead of a stop. The whole job (exit code 143,
the stop line, a verified checkpoint) is tests/dist/test_local_signals.py's split case."""
import contextlib
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from verl_hpc.config import load_config
from verl_hpc.runtime.launch_env import LaunchEnv
from verl_hpc.runtime.split import Mailbox, SplitWorld
from verl_hpc.trainer.placement import rollout_worker
from verl_hpc.trainer.placement.async_link import AsyncLink

TIMEOUT_S = 60  # every wait's limit: what a wait that misses the other group's leaving sits out
PROMPT_S = 15  # "at once", on a loaded machine: far below TIMEOUT_S


class Actor:
    """What the weight publisher exports: one tensor."""

    def export_hf_weights(self):
        yield "w", torch.arange(6, dtype=torch.float32).reshape(2, 3)


class Engine:
    """The rollout engine as the weight load sees it; `fail` makes it fail after taking them."""

    def __init__(self, fail=None):
        self.loads, self.fail = [], fail

    def load_weights(self, stream):
        self.loads.append({name: t.clone() for name, t in stream})
        if self.fail is not None:
            raise self.fail


class LateRequests(Mailbox):
    """The rollout leader's mailbox, its weight requests held back until `release` (the race of a
    stop with a request made deterministic: the request goes out after the trainer stopped)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asking, self.release = threading.Event(), threading.Event()

    def put(self, key, value):
        if key.startswith("weights/request/"):
            self.asking.set()
            assert self.release.wait(TIMEOUT_S)
        super().put(key, value)


class Job:
    """One rollout rank and one training rank of a split job (global ranks 0 and 1), in threads."""

    def __init__(self, late_requests=False):
        self.server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                                    wait_for_workers=False)
        self.cfg = load_config(None, ["placement.mode=split", "placement.rollout_ranks=1", "slurm.tasks_per_node=2",
                                      "resharding.mode=full", "async_training.staleness=1",
                                      f"trainer.collective_timeout_s={TIMEOUT_S}"])
        self.train = self._world("train", Mailbox)
        self.rollout = self._world("rollout", LateRequests if late_requests else Mailbox)
        self.link = AsyncLink(self.cfg, type("Ctx", (), {"split": self.train})())
        self.outcome = {}

    def _world(self, role, mailbox):
        port = self.server.port
        store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        env = LaunchEnv("single", 0, 1, 0, 1, 0, "127.0.0.1", port - 1)
        me = "rollout rank 0" if role == "rollout" else "training rank 0"
        return SplitWorld(role=role, global_rank=0 if role == "rollout" else 1, global_world=2, rollout_ranks=1,
                          local_env=env, store=store, mailbox=mailbox(store, me, TIMEOUT_S), timeout_s=TIMEOUT_S,
                          backend="gloo", store_addr=("127.0.0.1", port))

    def start_rollout(self, engine, monkeypatch) -> threading.Thread:
        """The rollout ranks' program (rollout_worker.run) on a thread; its result or error in `outcome`."""
        monkeypatch.setattr("verl_hpc.trainer.roles.load_tokenizer", lambda cfg: None)
        monkeypatch.setattr("verl_hpc.rollout.build_rollout", lambda cfg, ctx: contextlib.nullcontext(engine))
        monkeypatch.setattr(rollout_worker.PromptLoader, "from_config", lambda *a, **k: None)  # no batch starts here
        ctx = type("Ctx", (), {"split": self.rollout})()

        def body():
            try:
                self.outcome["result"] = rollout_worker.run(self.cfg, ctx)
            except BaseException as e:  # noqa: BLE001 - the test reads it
                self.outcome["error"] = e
            self.outcome["ended"] = time.monotonic()

        thread = threading.Thread(target=body, name="rollout-rank", daemon=True)
        thread.start()
        return thread

    def rollout_ends(self, thread, since: float) -> dict:
        """The rollout program's summary, once it ended promptly after `since` (and without an error)."""
        thread.join(TIMEOUT_S + 30)
        assert not thread.is_alive(), "the rollout rank still waits"
        assert "error" not in self.outcome, f"the rollout rank failed: {self.outcome['error']}"
        took = self.outcome["ended"] - since
        assert took < PROMPT_S, f"the rollout rank ended {took:.0f} s after the trainer stopped"
        return self.outcome["result"]


@pytest.fixture
def job():
    made = []
    yield lambda **k: made.append(Job(**k)) or made[-1]
    for j in made:
        j.link.stop()  # the weight server thread, if a test left it running


def test_a_stop_just_before_the_rollouts_weight_request_reaches_it_at_once(job, monkeypatch):
    # the race of the issue: the trainer publishes, the rollout decides to load, the trainer stops
    # (its weight server closed) and only then does the rollout's request go out
    j = job(late_requests=True)
    engine = Engine()
    thread = j.start_rollout(engine, monkeypatch)
    j.link.start(0)
    j.link.publish(Actor(), 0)
    assert j.rollout.mailbox.asking.wait(PROMPT_S), "the rollout rank never asked for the weights"
    j.link.stop()
    stopped = time.monotonic()
    j.rollout.mailbox.release.set()
    summary = j.rollout_ends(thread, stopped)
    assert engine.loads == [] and summary["version"] == -1, "weights were sent after the stop"
    assert not j.train.mailbox.has("weights/request/0")  # withdrawn: nothing left for a server


def test_a_request_the_closing_weight_server_took_is_answered_with_none(job):
    j = job()
    j.link.publish(Actor(), 0)
    j.link.publisher.close()  # closing: what it takes now, it answers with "no weights come"
    j.rollout.mailbox.put("weights/request/0", True)
    j.link.publisher._serve()  # its loop, on this thread: takes the request, answers, ends
    assert j.rollout.mailbox.wait("weights/manifest/0", "the weight server", timeout_s=PROMPT_S)
    assert j.rollout.mailbox.take("weights/manifest/0") is None


def test_weights_sent_then_a_stop_while_the_rollout_waits_for_newer_ones(job, monkeypatch):
    j = job()
    engine = Engine()
    thread = j.start_rollout(engine, monkeypatch)
    j.link.start(2)  # at step 2 (k = 1): batch 3 needs version 1, so after taking version 0 it waits
    j.link.publish(Actor(), 0)
    deadline = time.monotonic() + PROMPT_S
    while not engine.loads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.loads and torch.equal(engine.loads[0]["w"], torch.arange(6.0).reshape(2, 3))
    j.link.stop()
    assert j.rollout_ends(thread, time.monotonic())["version"] == 0


def test_a_trainer_that_stops_before_its_go_lets_the_rollout_go_at_once(job, monkeypatch):
    j = job()
    thread = j.start_rollout(Engine(), monkeypatch)
    time.sleep(0.5)  # the rollout rank waits for the go
    j.link.stop()  # e.g. the trainer failed to resume: RemoteRollout's exit stops the link
    assert j.rollout_ends(thread, time.monotonic())["batches"] == 0


def test_a_trainer_that_stops_after_asking_for_a_generation_lets_the_rollout_go(job, monkeypatch):
    j = job()
    thread = j.start_rollout(Engine(), monkeypatch)
    j.link.start(0)
    # a validation asking for weights of version 3, which this trainer will never publish
    j.train.mailbox.put("gen/request/0", (0, [[1, 2, 3]], None, 3))
    deadline = time.monotonic() + PROMPT_S
    while j.train.mailbox.has("gen/request/0") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not j.train.mailbox.has("gen/request/0"), "the rollout rank never took the request"
    time.sleep(0.2)  # it waits for version 3 now
    j.link.stop()
    j.rollout_ends(thread, time.monotonic())
    assert not j.train.mailbox.has("gen/result/0")


def test_a_rollout_group_failing_ends_the_trainers_wait_for_a_batch_at_once(job, monkeypatch):
    j = job()
    thread = j.start_rollout(Engine(fail=RuntimeError("the engine died loading weights")), monkeypatch)
    j.link.start(0)
    j.link.publish(Actor(), 0)
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        j.link.next_batch(1, 0, lambda stage: contextlib.nullcontext())
    took = time.monotonic() - t0
    assert took < PROMPT_S, f"the trainer waited {took:.0f} s for a batch from a failed rollout group"
    assert type(err.value).__name__ == "GroupLostError" and err.value.exit_code == 25, err.value
    assert str(err.value) == ("training rank 0: the rollout group failed while we waited for 'batch/1' (rollout "
                              "rank 0 (global 0): RuntimeError: the engine died loading weights): see its log")
    thread.join(PROMPT_S)
    assert isinstance(j.outcome.get("error"), RuntimeError)  # the rollout rank fails with its own error


def test_the_published_snapshot_is_in_the_rollouts_dtype(job):
    """Split placement's publisher sends what the rollout keeps (model.dtype on GPUs: bf16 or fp16;
    fp32 on this CPU), cast once on the training side, bucket bytes counted in it."""
    from verl_hpc.rollout.engine import rollout_weight_dtype

    j = job()
    assert j.link.publisher.dtype == rollout_weight_dtype("float32") == torch.float32  # a CPU here
    j.link.publisher.dtype = torch.float16  # as on a GPU job with model.dtype = float16
    m = j.link.publish(Actor(), 0)
    _, buckets, manifest, _ = j.link.publisher._snapshot
    assert [(row[0], row[1]) for row in manifest] == [("w", "torch.float16")]
    from verl_hpc.resharding.bridge import unpack

    ((name, t),) = unpack(buckets[0], manifest)
    assert t.dtype == torch.float16 and torch.equal(t, torch.arange(6.0).reshape(2, 3).half())
    assert m["sync/buckets"] == 1.0
    j.link.publisher.close()
