"""The elastic workers' weight pair (trainer/placement/elastic/channel.py) is gloo over host buffers
on GPU nodes too: a worker is another Slurm job that may die, and on NCCL its timeout would reach
the first training rank through NCCL's watchdog (which tears the process down under
TORCH_NCCL_ASYNC_ERROR_HANDLING). The GPU is stubbed: has_gpu() true changes nothing."""
import datetime
import threading

import torch
import torch.distributed as dist

from verl_hpc.runtime import device as devices
from verl_hpc.trainer.placement.elastic.channel import pair_group


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
