"""Weights to elastic rollout workers (trainer/placement/elastic/channel.py): two worker processes
(other jobs, in a real run) make their pairs with the server through the run's store and fetch the
newest snapshot over them, bucket by bucket, exactly; a worker killed in the middle of its transfer
fails only that transfer (the server drops it at once and names why), and the other worker goes on
to take the next version."""
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from verl_hpc.resharding.bridge import pack
from verl_hpc.runtime.split import Mailbox
from verl_hpc.trainer.placement.elastic.channel import ElasticWeightServer

WORKER = Path(__file__).with_name("elastic_channel_worker.py")
REPO = Path(__file__).resolve().parents[3]


def weights(version: int):
    g = torch.Generator().manual_seed(version)
    # 8 MB tensors: far more than a socket buffers, so a send blocks until its peer reads
    return [("embed.weight", torch.randn(2048, 1024, generator=g)), ("layer.0.q.weight", torch.randn(64, 64, generator=g)),
            ("layer.0.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(2048, 1024, generator=g))]


def start(port, worker, mode, out):
    return subprocess.Popen([sys.executable, str(WORKER), str(port), worker, mode, str(out)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, proc, timeout=90):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None or path.exists(), proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.05)


class Run:
    """The run's side: its store, the first training rank's server on it, the snapshots it publishes."""

    def __init__(self, form_s=None):
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                                   wait_for_workers=False)
        self.port, self.current = self.store.port, {}
        self.server = ElasticWeightServer(self.connect, lambda: self.current.get("snap"), timeout_s=60)
        if form_s is not None:  # a shorter bound on a pair's forming than the server's own (30 s)
            self.server.form_s = form_s
        self.server.start()

    def connect(self):
        store = dist.TCPStore("127.0.0.1", self.port, None, False, timeout=datetime.timedelta(seconds=60))
        return Mailbox(store, "training rank 0", 60)

    def publish(self, version):
        buckets, manifest = pack(weights(version), bucket_bytes=4 << 20)  # several buckets
        self.current["snap"] = (version, buckets, manifest)


def test_pairs_fetch_exactly_and_a_killed_worker_fails_only_itself(tmp_path):
    run = Run()
    server, port, publish = run.server, run.port, run.publish
    procs = []
    try:
        staller = start(port, "stalls", "stall", tmp_path)
        procs.append(staller)
        wait_for(tmp_path / "stalls.stalling", staller)
        good = start(port, "good", "fetch", tmp_path)
        procs.append(good)
        publish(1)  # the staller asked first: the server goes into its transfer, held
        wait_for(tmp_path / "stalls.held", staller)  # (a fixed sleep let a loaded machine kill it earlier)
        t0 = time.monotonic()
        staller.send_signal(signal.SIGKILL)
        wait_for(tmp_path / "good.v1.pt", good)
        assert time.monotonic() - t0 < 30, "the server must notice the dead worker at once, not after its timeout"
        assert [w for w, _ in server.lost] == ["stalls"] and "weight transfer failed" in server.lost[0][1]
        publish(2)
        assert good.wait(timeout=90) == 0, good.communicate()[0][-3000:]
        for version in (1, 2):
            got = torch.load(tmp_path / f"good.v{version}.pt")
            want = dict(weights(version))
            assert list(got) == list(want)
            assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
        assert server.sent == {"good": 2}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()


def test_a_worker_killed_before_its_pair_formed_does_not_hold_another_workers_fetch(tmp_path):
    """A worker killed in its first fetch, after its pair request and before its side of the pair:
    the server's side waits for it (up to its forming bound), but only in that worker's own thread,
    so another worker's next snapshot comes at once (issue 76 item 5: on one serving thread it came
    after the timeout, past the other worker's own, which then left the pool)."""
    run = Run(form_s=5)
    procs = []
    try:
        good = start(run.port, "good", "fetch", tmp_path)
        procs.append(good)
        run.publish(1)
        wait_for(tmp_path / "good.v1.pt", good)
        dead = start(run.port, "dead", "pairless", tmp_path)
        procs.append(dead)
        wait_for(tmp_path / "dead.posted", dead)
        time.sleep(0.5)  # the server has seen the request and waits for the dead side of the pair
        dead.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        run.publish(2)
        wait_for(tmp_path / "good.v2.pt", good)
        # on one serving thread the wait for the dead side (the server's timeout, 60 s) came first
        assert time.monotonic() - t0 < 15, "the dead worker's pair held the other worker's fetch"
        assert good.wait(timeout=30) == 0, good.communicate()[0][-3000:]
        assert run.server.sent == {"good": 2}
        deadline = time.monotonic() + 30
        while not run.server.lost and time.monotonic() < deadline:  # its own thread gives up on it
            time.sleep(0.1)
        assert [w for w, _ in run.server.lost] == ["dead"], run.server.lost
        assert "its pair group did not form within 5 s" in run.server.lost[0][1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        run.server.close()
