"""A rollout worker's weight fetcher for tests/dist/trainer/test_elastic_channel.py, as a process
of its own (another Slurm job in a real run): connects to the test's store, makes its pair with the
server, and fetches.

    python elastic_channel_worker.py PORT WORKER MODE OUT
MODE fetch: fetch the newest snapshot, save it to OUT/WORKER.v<version>.pt; then wait for a newer
one and save that too. MODE stall: ask, then stop before taking the buckets, saying so in
OUT/WORKER.held (the test kills it there, mid-transfer). MODE pairless: post its pair request, then
stop before forming its side of the pair (the test kills it there, as a worker killed in its first
fetch)."""
import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from verl_hpc.runtime.split import Mailbox
from verl_hpc.trainer.placement.elastic.channel import PAIRS, WeightFetcher


def main(port: int, worker: str, mode: str, out: Path) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    if mode == "pairless":  # WeightFetcher's first two steps, not its third (forming its side)
        mail = Mailbox(store, f"worker {worker}", 60)
        mail.put(f"elastic/pair/{mail.add(PAIRS, 1) - 1}", (worker, 0))
        (out / f"{worker}.posted").write_text("")
        time.sleep(600)
    fetch = WeightFetcher(Mailbox(store, f"worker {worker}", 60), worker, timeout_s=60)
    if mode == "stall":
        class Held:  # its side of the transfer never starts
            def broadcast(self, *args, **kwargs):
                (out / f"{worker}.held").write_text("")  # it has the head: the server's side is in the transfer
                time.sleep(600)

        fetch.pair = Held()
        (out / f"{worker}.stalling").write_text("")
        while fetch.newest() is None:  # until a snapshot is there: then it holds the transfer
            time.sleep(0.05)
        return
    for _ in range(2):
        got = None
        while got is None:
            got = fetch.newest()
            time.sleep(0.05)
        version, tensors = got
        torch.save({name: t.clone() for name, t in tensors}, out / f"{worker}.v{version}.pt")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]))
