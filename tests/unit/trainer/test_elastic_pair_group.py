"""The elastic workers' weight pair (trainer/placement/elastic/channel.py) is gloo over host buffers
on GPU nodes too: a worker is another Slurm job that may die, and on NCCL its timeout would reach
the first training rank through NCCL's watchdog (which tears the process down under
TORCH_NCCL_ASYNC_ERROR_HANDLING). The GPU is stubbed: has_gpu() true changes nothing. A worker
the run took out of the pool hears so in its weight request at once."""
import datetime
import threading

import torch
import torch.distributed as dist

from verl_hpc.runtime import device as devices
import pytest

from verl_hpc.runtime.split import GroupLostError, Mailbox
from verl_hpc.trainer.placement.elastic.channel import WeightFetcher, left_key, pair_group


def test_the_pair_is_gloo_with_the_timeout_on_a_gpu_node_too(monkeypatch, tmp_path):
    monkeypatch.setattr(devices, "has_gpu", lambda: True)
    store = dist.FileStore(str(tmp_path / "store"), 2)
    groups = {}

    def make(rank):
        groups[rank] = pair_group(store, "w1", 0, rank, timeout_s=7)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(g, dist.ProcessGroupGloo) for g in groups.values())
    assert all(g.options._timeout == datetime.timedelta(seconds=7) for g in groups.values())
    sent, got = torch.arange(5, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)
    works = {}

    def bcast(rank, buf):
        works[rank] = groups[rank].broadcast([buf], dist.BroadcastOptions())
        works[rank].wait()

    threads = [threading.Thread(target=bcast, args=a) for a in ((0, sent), (1, got))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(got, sent)  # a host buffer crosses, as the server and the fetcher send it


def test_a_worker_out_of_the_pool_hears_so_in_its_fetch_not_after_the_timeout():
    """Reaped while alive (a long pause), a worker's weight request has no server thread left to
    answer it: the run's left/<member> key ends its wait at once, naming why."""
    store = dist.HashStore()
    fetch = WeightFetcher.__new__(WeightFetcher)  # its pair is not needed: no answer comes
    fetch.mail, fetch.worker, fetch.timeout_s = Mailbox(store, "elastic rollout worker w", 600.0), "w/3", 600.0
    fetch.asked, fetch.version = 0, -1
    Mailbox(store, "rollout rank 0", 10.0).put(left_key("w/3"), "no heartbeat for 61 s (killed, or its node lost)")
    with pytest.raises(GroupLostError, match=r"the run took it out of the pool \(no heartbeat for 61 s"):
        fetch.newest()
