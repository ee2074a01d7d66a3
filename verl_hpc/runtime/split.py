"""Split placement: one srun step, two worlds. The job's first R ranks roll out, the rest train.

    world = SplitWorld.start(env, rollout_ranks=R, backend=..., timeout_s=...)  # before any group
    world.role            # "rollout" | "train"
    world.local_env       # this rank's LaunchEnv inside its own group (rank, world_size rebased)
    world.mailbox         # job-wide key-value messages between the groups (the TCP store)
    world.weights_group   # the first training rank + every rollout rank: the weight broadcast

Why two default groups rather than one world with subgroups: Megatron-Core carves its TP/PP/DP
groups out of the default group and requires tp * pp * dp to equal its size, and vLLM's external
launcher makes the default group its world; giving each side a default group of its own ranks
lets both libraries run unchanged. Both groups, and the bridge between them, rendezvous through
one TCP store that global rank 0 serves on a port the kernel picks, whose number it passes on
through the job's rendezvous store at MASTER_ADDR:MASTER_PORT (torchrun's agent serves that one,
else rank 0; a fixed neighbour such as MASTER_PORT + 1 may be held by any process on the node);
the store is also the mailbox (small messages: batches of token ids, control flags), polled with
`check` so that a wait can also watch for the other group failing. Weights go over a real
collective (gloo on CPU, NCCL on GPU), bucketed.

Faults: the store lives on global rank 0 (a rollout rank). If it dies, every store call of the
training ranks fails at once, and `Mailbox` turns that into one line naming the rollout group; if
a training rank dies, the launcher (srun --kill-on-bad-exit, the local launcher) ends the job, and
a rollout rank waiting on the trainer gives up after `timeout_s` naming the training group. A
weight broadcast whose peer died fails at once (gloo sees the closed connection), or after
`timeout_s` (NCCL's group gets the same limit), as a GroupLostError naming the other side. The
rollout leader keeps the store up until the trainer says goodbye (`finish`), so the trainer's last
messages always have a store to go to.

Leaving: every wait of one group on the other also watches the other group's leaving key, so that
a stop reaches a waiting rank at once instead of after `timeout_s`: the rollout group's waits watch
STOP (the trainer is done: finished, stopped by a signal, or failed), the training group's watch
ROLLOUT_FAILED (the rollout group is leaving on an error, with its line).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.placement import rank_role
from verl_hpc.errors import VerlHpcError
from verl_hpc.runtime.launch_env import LaunchEnv

log = logging.getLogger(__name__)
POLL_S = 0.02  # mailbox polling period: far below a generation chunk, far above a store round trip
STOP = "ctl/stop"  # the trainer is done (finished, stopped or failed): the rollout group leaves
ROLLOUT_FAILED = "ctl/rollout_failed"  # the rollout group is leaving on an error: its line


class GroupLostError(VerlHpcError, RuntimeError):
    """The other group of a split job stopped answering (a rank died, or it is stuck)."""

    exit_code, kind = 25, "split placement"


@dataclasses.dataclass
class Mailbox:
    """Pickled messages under string keys in the job's TCP store, with waits that name who is late."""

    store: Any
    me: str  # "rollout rank 0", "training rank 0": for messages
    timeout_s: float

    def put(self, key: str, value: Any) -> None:
        self._call(lambda: self.store.set(key, pickle.dumps(value)), key)

    def has(self, key: str) -> bool:
        return bool(self._call(lambda: self.store.check([key]), key))

    def take(self, key: str) -> Any:
        """The value under `key` (which must exist), removed from the store."""
        value = pickle.loads(self._call(lambda: self.store.get(key), key))
        self._call(lambda: self.store.delete_key(key), key)
        return value

    def peek(self, key: str) -> Any:
        return pickle.loads(self._call(lambda: self.store.get(key), key))

    def add(self, key: str, amount: int = 1) -> int:
        """The store's counter under `key` after adding `amount` (0 reads it): a numbered stream of
        keys (joins, pair requests) whose next number every party can take without a race."""
        return int(self._call(lambda: self.store.add(key, amount), key))

    def claim(self, key: str) -> bool:
        """Remove `key`; True only for the one caller that removed it (the store's delete is
        atomic), so a request is either taken by its server or withdrawn by its sender, never both."""
        return bool(self._call(lambda: self.store.delete_key(key), key))

    def wait(self, key: str, who: str, *, timeout_s: Optional[float] = None, unless: Optional[str] = None,
             watch: Optional[Callable[[], None]] = None) -> bool:
        """True once `key` exists; False if `unless` (the other group's leaving key: STOP,
        ROLLOUT_FAILED) exists first, since then no answer will come; after the timeout a
        GroupLostError naming `who` (the party that should have written `key`). `watch` is called
        on every poll: a waiter's own reasons to give up (a signal, the run refusing it) raise there."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while not self.has(key):
            if watch is not None:
                watch()
            if unless is not None and self.has(unless):
                return False
            if time.monotonic() > deadline:
                raise GroupLostError(f"{self.me}: {who} did not answer within {limit:.0f} s (waiting for "
                                     f"'{key}'); it died or is stuck: see its log")
            time.sleep(POLL_S)
        return True

    def _call(self, fn, key):
        try:
            return fn()
        except (dist.DistStoreError, RuntimeError, ConnectionError) as e:
            # the store lives in global rank 0, the rollout leader: losing it means losing that rank
            other = f"the rollout group ({STORE_HOLDER})" if self.me.startswith("training") else STORE_HOLDER
            raise GroupLostError(f"{self.me}: lost {other} at '{key}' ({_first_line(e)}); it died or cannot "
                                 "be reached: see its log") from None


STORE_HOLDER = "global rank 0 (rollout rank 0), which serves the job's store"


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__


def _span(lo: int, hi: int) -> str:
    """`global rank 0`, `global ranks 0-3`: the ranks lo..hi-1."""
    return f"global rank {lo}" if hi - lo == 1 else f"global ranks {lo}-{hi - 1}"


SPLIT_PORT_KEY = "verl_hpc/split_store_port"


def _split_store(env: LaunchEnv, timeout: datetime.timedelta):
    """(the split store, the job's rendezvous store). Global rank 0 opens the split store on a port
    the kernel gives it (no window in which another process can take the port) and publishes the
    number in the job's store; the other ranks read it there and connect."""
    url = f"tcp://{env.master_addr}:{env.master_port}"
    job_store, _, _ = next(dist.rendezvous(url, rank=env.rank, world_size=env.world_size, timeout=timeout))
    if env.rank == 0:
        store = dist.TCPStore(env.master_addr, 0, env.world_size, True, timeout=timeout, wait_for_workers=False)
        job_store.set(SPLIT_PORT_KEY, str(store.port))
        return store, job_store
    port = int(job_store.get(SPLIT_PORT_KEY))
    return dist.TCPStore(env.master_addr, port, env.world_size, False, timeout=timeout), job_store


@dataclasses.dataclass
class SplitWorld:
    role: str
    global_rank: int
    global_world: int
    rollout_ranks: int
    local_env: LaunchEnv
    store: Any
    mailbox: Mailbox
    timeout_s: float
    backend: str
    store_addr: tuple = ("", 0)
    device: Any = None  # this rank's torch device (NCCL moves device memory only)
    _weights_group: Any = None
    _job_store: Any = None  # held: on global rank 0 outside torchrun it serves the rendezvous

    @property
    def train_ranks(self) -> int:
        return self.global_world - self.rollout_ranks

    @property
    def is_leader(self) -> bool:
        """Rank 0 of its own group: the one that talks to the other group."""
        return self.local_env.rank == 0

    @property
    def name(self) -> str:
        return f"{'rollout' if self.role == 'rollout' else 'training'} rank {self.local_env.rank} " \
               f"(global {self.global_rank})"

    @classmethod
    def start(cls, env: LaunchEnv, *, rollout_ranks: int, backend: str, timeout_s: float,
              device=None) -> "SplitWorld":
        """Connect to the job's store and initialise this rank's own default group. Collective
        over the whole job (every rank calls it once, before anything else is distributed)."""
        if not 0 < rollout_ranks < env.world_size:
            raise ConfigError(f"placement.rollout_ranks = {rollout_ranks}: must be in 1..{env.world_size - 1} "
                              f"(world size {env.world_size})")
        role = rank_role(env.rank, rollout_ranks)
        offset, size = (0, rollout_ranks) if role == "rollout" else (rollout_ranks, env.world_size - rollout_ranks)
        timeout = datetime.timedelta(seconds=timeout_s)
        store, job_store = _split_store(env, timeout)
        local = dataclasses.replace(env, rank=env.rank - offset, world_size=size)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"{role}/", store),
                                rank=local.rank, world_size=size, timeout=timeout,
                                **({"device_id": device} if backend == "nccl" and device is not None else {}))
        me = f"{'rollout' if role == 'rollout' else 'training'} rank {local.rank}"
        world = cls(role=role, global_rank=env.rank, global_world=env.world_size, rollout_ranks=rollout_ranks,
                    local_env=local, store=store, mailbox=Mailbox(store, me, timeout_s), timeout_s=timeout_s,
                    backend=backend, store_addr=(env.master_addr, store.port), device=device,
                    _job_store=job_store)
        log.info("split placement: global rank %d is %s (%d rollout + %d training ranks)", env.rank,
                 world.name, rollout_ranks, world.train_ranks)
        return world

    def thread_mailbox(self) -> Mailbox:
        """A mailbox on a store connection of its own, for a background thread."""
        store = dist.TCPStore(self.store_addr[0], self.store_addr[1], self.global_world, False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        return Mailbox(store, self.mailbox.me, self.timeout_s)

    # -------------------------------------------------------------------------------- the bridge
    def in_weights_group(self) -> bool:
        return self.role == "rollout" or self.local_env.rank == 0

    @property
    def weights_group(self):
        """The weight broadcast's group: group rank 0 = the first training rank, 1.. = the rollout
        ranks. Built on first use, by its members only (it is not a torch.distributed subgroup of a
        default group: the two sides have different default groups)."""
        if self._weights_group is None:
            if not self.in_weights_group():
                raise RuntimeError(f"{self.name} is not in the weight broadcast group")
            me = 0 if self.role == "train" else 1 + self.local_env.rank
            size = 1 + self.rollout_ranks
            prefix = dist.PrefixStore("bridge/weights/", self.store)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            if self.backend == "nccl":
                # NCCL's own default (10 min or more) would hold a dead peer's broadcast past the
                # job's collective timeout
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._weights_group = dist.ProcessGroupNCCL(prefix, me, size, options)
            else:
                self._weights_group = dist.ProcessGroupGloo(prefix, me, size, timeout)
        return self._weights_group

    def wire_device(self):
        """Where a bucket must be to cross the weights group: the GPU for NCCL, else the host."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor) -> None:
        """Broadcast `tensor` from the first training rank to every rollout rank (in place). With
        NCCL a host tensor goes through a device copy (the snapshot stays in host memory, so one
        bucket at a time is on the GPU)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        wire = tensor if tensor.device == self.wire_device() else tensor.to(self.wire_device())
        try:
            if wire.is_cuda:  # the weight server is a thread of its own: CUDA's current device is per thread
                torch.cuda.set_device(wire.device)
            self.weights_group.broadcast([wire], opts).wait()
            if wire is not tensor and self.role == "rollout":  # received: back where the caller wants it
                tensor.copy_(wire)
        except RuntimeError as e:  # a member closed its connection (died) or passed the timeout
            raise GroupLostError(f"{self.name}: the weight broadcast failed ({_first_line(e)}): "
                                 f"{self._broadcast_peers()} died or is stuck: see its log") from None

    def scatter(self, tensor, sizes=None) -> None:
        """The first training rank sends every rollout rank its own part (the sliced weight
        sync): on the first training rank `tensor` holds the parts in rollout-rank order and
        `sizes` their bytes; on a rollout rank `tensor` receives its part. One all_to_all over the
        weights group in which only the first training rank sends."""
        members = 1 + self.rollout_ranks
        device = self.wire_device()
        try:
            if device.type == "cuda":  # the weight server is a thread of its own: CUDA's current device is per thread
                torch.cuda.set_device(device)
            if self.role == "train":
                wire = tensor if tensor.device == device else tensor.to(device)
                out = torch.empty(0, dtype=tensor.dtype, device=device)
                self.weights_group.alltoall_base(out, wire, [0] * members, [0] + list(sizes),
                                                 dist.AllToAllOptions()).wait()
            else:
                wire = tensor if tensor.device == device else torch.empty_like(tensor, device=device)
                nothing = torch.empty(0, dtype=tensor.dtype, device=device)
                self.weights_group.alltoall_base(wire, nothing, [tensor.numel()] + [0] * (members - 1),
                                                 [0] * members, dist.AllToAllOptions()).wait()
                if wire is not tensor:
                    tensor.copy_(wire)
        except RuntimeError as e:  # a member closed its connection (died) or passed the timeout
            raise GroupLostError(f"{self.name}: the weight exchange failed ({_first_line(e)}): "
                                 f"{self._broadcast_peers()} died or is stuck: see its log") from None

    def _broadcast_peers(self) -> str:
        """Who else is in the weight broadcast, as this rank sees it."""
        if self.role == "train":
            return f"the rollout group ({_span(0, self.rollout_ranks)})"
        first = f"the first training rank (global rank {self.rollout_ranks})"
        return first + (" or another rollout rank" if self.rollout_ranks > 1 else "")

    # -------------------------------------------------------------------------------- the end
    def leave_on_error(self, exc: BaseException) -> None:
        """Rollout leader, leaving on an error: say so (ROLLOUT_FAILED, with its line), so that a
        training rank waiting on the rollout group fails at once naming it, not after timeout_s
        (the store stays up until `finish`, so a wait would otherwise see nothing wrong)."""
        if self.role != "rollout" or not self.is_leader:
            return  # a rollout rank that is not the leader ends the job by dying (the launcher)
        why = str(exc).splitlines()[0] if isinstance(exc, VerlHpcError) and str(exc) else _first_line(exc)
        try:
            self.mailbox.put(ROLLOUT_FAILED, f"{self.name}: {why}")
        except GroupLostError as e:
            log.warning("split placement: %s", e)

    def finish(self) -> None:
        """Training leader: tell the rollout leader it may take the store down. Rollout leader:
        wait (bounded) for that, so the trainer's last messages have a store to go to."""
        try:
            if self.role == "train" and self.is_leader:
                self.mailbox.put("ctl/bye", True)
            elif self.role == "rollout" and self.is_leader:
                self.mailbox.wait("ctl/bye", "the training group", timeout_s=min(self.timeout_s, 600))
        except GroupLostError as e:
            log.warning("split placement: %s", e)
