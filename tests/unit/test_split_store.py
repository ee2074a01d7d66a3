"""The split store's address (runtime/split.py): global rank 0 opens it on a port the kernel picks
and passes the number on through the job's rendezvous store, so a port held by another process
(MASTER_PORT + 1 here, as any neighbour of the rendezvous port can be) never fails the job. Both
ways the job's store is served: by rank 0 (srun, mpirun) and by torchrun's agent (the local
launcher; here this process, as the agent)."""
import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from verl_hpc.runtime.launch_env import LaunchEnv
from verl_hpc.runtime.local_ranks import free_port, host_store
from verl_hpc.runtime.split import _split_store

TIMEOUT = datetime.timedelta(seconds=60)


def _occupy(port: int):
    """A listener on `port` (None where someone else already holds it: occupied either way)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


@pytest.mark.parametrize("served_by", ["rank 0", "agent"])
def test_ranks_meet_on_the_store_rank_0_opened_with_the_next_port_taken(served_by, monkeypatch):
    agent = None
    if served_by == "agent":
        agent = host_store()
        port = agent.port
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    else:
        port = free_port()
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    taken = _occupy(port + 1)
    got, errors = {}, []

    def rank(r: int):
        try:
            env = LaunchEnv(launcher="srun", rank=r, world_size=2, local_rank=r, local_world_size=2, node_rank=0,
                            master_addr="127.0.0.1", master_port=port)
            got[r] = _split_store(env, TIMEOUT)
        except Exception as e:  # noqa: BLE001 - reported below with its rank
            errors.append((r, repr(e)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        assert not errors and len(got) == 2, errors
        (store0, _), (store1, _) = got[0], got[1]
        assert store0.port == store1.port != port + 1
        store0.set("from rank 0", "hello")
        assert store1.get("from rank 0") == b"hello"
        assert isinstance(store1, dist.TCPStore)
    finally:
        if taken is not None:
            taken.close()
        del agent
