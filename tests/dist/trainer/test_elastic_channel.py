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


def test_pairs_fetch_exactly_and_a_killed_worker_fails_only_itself(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    port = store.port
    current = {}

    def snapshot():
        return current.get("snap")

    def publish(version):
        buckets, manifest = pack(weights(version), bucket_bytes=4 << 20)  # several buckets
        current["snap"] = (version, buckets, manifest)

    def connect():
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
        return Mailbox(store, "training rank 0", 60)

    server = ElasticWeightServer(connect, snapshot, timeout_s=60).start()
    procs = []
    try:
        staller = start(port, "stalls", "stall", tmp_path)
        procs.append(staller)
        wait_for(tmp_path / "stalls.stalling", staller)
        good = start(port, "good", "fetch", tmp_path)
        procs.append(good)
        publish(1)  # the staller asked first: the server is now in its transfer, held
        time.sleep(1.0)
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
