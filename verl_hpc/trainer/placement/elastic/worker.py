"""An elastic rollout worker: a process of its own (a Slurm job, `python -m verl_hpc.submit --join
RUN_DIR`) that joins a running split run, generates the prompt groups it leases, and leaves.

    python -m verl_hpc.submit --join RUN_DIR --local [overrides, e.g. rollout.engine=hf]   # main() here

1. Find the run (rendezvous.py): its store, its epoch, its config (`RUN_DIR/elastic/config.yaml`);
   overrides may change only this worker's engine (rollout.tp, gpu_memory_utilization, ...).
2. Build the rollout engine, join the pool (elastic/join) and wait for the run's verdict on that join
   (a second worker of a name already in the pool is refused, exit 30; a Slurm requeue of a worker,
   its job id and a higher SLURM_RESTART_COUNT, is taken as a new member), start beating
   (elastic/beat/<member>: everything it says from here is under its name and its join's number).
3. Loop: newer weights? fetch them over the worker's pair with the first training rank
   (channel.py) and load them; ask for leases (elastic/want) with the version held; generate each
   leased group with its own seed; post the samples (elastic/done).
4. Leave: on SIGTERM / SIGUSR1 / SIGINT (scancel, the time limit's warning, Ctrl-C) after the group
   in hand, saying why (elastic/bye); when the run stops (its STOP key, or its rendezvous no longer
   running) or drops this worker; when the run's store goes away. Exit 0 in all these cases: the
   run goes on, or has ended, without it. A worker that cannot join exits 30 (ElasticJoinError).
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import List, Optional

from verl_hpc.runtime.split import POLL_S, STOP, GroupLostError, Mailbox
from verl_hpc.trainer.placement.elastic.rendezvous import ElasticJoinError, Rendezvous, config_path

log = logging.getLogger("verl_hpc.elastic.worker")
BEATS_PER_TIMEOUT = 5  # heartbeats per placement.elastic.heartbeat_timeout_s: a late one or two is no leave


def restart_count() -> int:
    """How many times Slurm has requeued this job (SLURM_RESTART_COUNT; 0 outside Slurm)."""
    raw = os.environ.get("SLURM_RESTART_COUNT", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ElasticJoinError(f"SLURM_RESTART_COUNT = {raw!r}: expected a whole number >= 0 (Slurm sets it on a requeue)")
    return int(raw)


def worker_id() -> str:
    """This worker's name in the pool: its Slurm job (and array task) where it has one."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if job:
        return f"{job}_{task}" if task else job
    return f"{socket.gethostname()}-{os.getpid()}"


class Leaving(Exception):
    def __init__(self, reason: str, said: bool = True):
        super().__init__(reason)
        self.reason, self.said = reason, said  # said: whether to post a goodbye (not after being dropped)


class Worker:
    def __init__(self, run_dir: str, overrides: List[str], name: Optional[str] = None):
        from verl_hpc.config import load_config

        self.run_dir = run_dir
        rdv = Rendezvous.join(run_dir)
        self.cfg = load_config(str(config_path(run_dir)), overrides)
        rdv = Rendezvous.join(run_dir, self.cfg)  # refused if the overrides touched what must be shared
        if self.cfg.rollout.tp != 1:
            from verl_hpc.config import ConfigError

            raise ConfigError(f"rollout.tp = {self.cfg.rollout.tp} for an elastic rollout worker: a worker is one "
                              "process with one engine (vLLM's tensor parallelism needs a rank per GPU, not built "
                              "for workers yet); join with rollout.tp=1")
        self.epoch, self.name = rdv.epoch, name or worker_id()
        self.restart = restart_count()  # a bad value is one line here, before the engine is built
        import torch.distributed as dist

        timeout = self.cfg.async_training.poll_timeout_s or self.cfg.trainer.collective_timeout_s
        self.timeout_s = timeout
        rdv.check_store()  # one line naming the file and its store, not c10d's traceback
        try:
            store = dist.TCPStore(rdv.store[0], rdv.store[1], None, False, timeout=datetime.timedelta(seconds=timeout))
        except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
            raise ElasticJoinError(f"{rdv.path}: the run's store at {rdv.store[0]}:{rdv.store[1]} (field 'store') "
                                   f"does not answer ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
        self.mail = Mailbox(store, f"elastic rollout worker {self.name}", timeout)
        self.signalled: Optional[str] = None
        self.member = self.name  # its member key once the run took its join (join_pool)
        self.wants = self.dones = 0
        self.version = -1

    # ------------------------------------------------------------------ the run
    def _check_run(self) -> None:
        """Leaving raised where this worker should go: a signal, the run's stop, the run's refusal."""
        if self.signalled:
            raise Leaving(self.signalled)
        if self.mail.has(STOP):
            raise Leaving("the run stopped", said=False)

    def join_pool(self) -> None:
        """Post this worker's join and wait for the run's verdict on it (by the join's number)
        before anything is sent under its name: a refused worker must not beat, ask for weights
        or leave in the name of the worker of that name already in the pool. Taken, it speaks under
        its member key (its name and the join's number), which no earlier run of its job used."""
        from verl_hpc.trainer.placement.elastic.coordinator import member_key

        index = self.mail.add("elastic/joins", 1) - 1
        self.mail.put(f"elastic/join/{index}", dict(worker=self.name, epoch=self.epoch, node=socket.gethostname(),
                                                job=os.environ.get("SLURM_JOB_ID", ""), pid=os.getpid(),
                                                restart=self.restart))
        key = f"elastic/verdict/{index}"
        if not self.mail.wait(key, "the run's rollout leader", unless=STOP, watch=self._check_run):
            raise Leaving("the run stopped", said=False)
        why = self.mail.take(key)
        if why:
            raise ElasticJoinError(f"elastic rollout worker {self.name}: the run in {self.run_dir} refused it: {why}")
        self.member = member_key(self.name, index)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        from verl_hpc.rollout import build_rollout
        from verl_hpc.rollout import SamplingSpec
        from verl_hpc.trainer.placement.elastic.channel import WeightFetcher
        from verl_hpc.trainer.roles import rollout_options

        for sig, why in ((signal.SIGTERM, "SIGTERM (scancel or preemption)"),
                         (signal.SIGUSR1, "SIGUSR1 (its time limit is near)"), (signal.SIGINT, "SIGINT")):
            signal.signal(sig, lambda *_, why=why: setattr(self, "signalled", f"stopped by {why}"))
        self.spec = SamplingSpec.from_config(self.cfg.rollout)
        with build_rollout(rollout_options(self.cfg), None) as rollout:
            try:
                self.join_pool()
            except Leaving as e:
                log.info("elastic worker %s: leaving: %s", self.name, e.reason)
                return 0
            beating = threading.Event()
            threading.Thread(target=self._beat, args=(beating,), daemon=True).start()
            log.info("elastic worker %s: joined %s", self.name, self.run_dir)
            fetcher = None
            try:
                fetcher = WeightFetcher(self.mail, self.member, self.timeout_s)
                while True:
                    self._check_run()
                    self._weights(rollout, fetcher)
                    if self.version < 0:
                        time.sleep(POLL_S)
                        continue
                    self._work(rollout)
            except Leaving as e:
                if e.said:
                    self.mail.put(f"elastic/bye/{self.member}", e.reason)
                log.info("elastic worker %s: leaving: %s", self.name, e.reason)
                return 0
            except GroupLostError as e:  # the run stopped answering (its weight server, a lease)
                log.info("elastic worker %s: leaving: %s", self.name, e)
                return 0
            except (RuntimeError, ConnectionError) as e:  # the run's store went away: the run ended
                log.info("elastic worker %s: the run's store is gone (%s): leaving", self.name, type(e).__name__)
                return 0
            finally:
                beating.set()

    def _beat(self, done: threading.Event) -> None:
        store = None
        period = self.cfg.placement.elastic.heartbeat_timeout_s / BEATS_PER_TIMEOUT
        while not done.wait(period if store is not None else 0):
            try:
                import torch.distributed as dist

                host, port = self.mail.store.host, self.mail.store.port
                store = store or dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=30))
                store.add(f"elastic/beat/{self.member}", 1)
            except Exception:  # noqa: BLE001 - the main loop notices a lost run
                return

    def _weights(self, rollout, fetcher) -> None:
        t0 = time.perf_counter()
        got = fetcher.newest()
        if got is None:
            return
        version, tensors = got
        rollout.load_weights(iter(tensors))
        if self.version < 0:  # the join's cost: its first weights, fetched and loaded
            self.mail.put(f"elastic/loaded/{self.member}", time.perf_counter() - t0)
        self.version = version
        log.info("elastic worker %s: weights version %d loaded in %.1f s", self.name, version, time.perf_counter() - t0)

    def _work(self, rollout) -> None:
        from verl_hpc.trainer.placement.elastic.coordinator import LEAVE

        n = self.wants
        self.mail.put(f"elastic/want/{self.member}/{n}", dict(version=self.version,
                                                              groups=self.cfg.placement.elastic.groups_per_lease))
        key = f"elastic/lease/{self.member}/{n}"
        self.mail.wait(key, "the run's rollout leader", watch=self._check_run)
        payloads = self.mail.take(key)
        self.wants += 1
        if payloads == LEAVE:
            raise Leaving("the run dropped it from the pool (it was silent too long)", said=False)
        if not payloads:
            time.sleep(POLL_S * 5)
            return
        done = {}
        for p in payloads:
            done[p["id"]] = self._generate(rollout, p)
            if self.signalled:
                break  # what it finished goes in; the rest goes back with its goodbye
        self.mail.put(f"elastic/done/{self.member}/{self.dones}", done)
        self.dones += 1
        log.info("elastic worker %s: %d group(s) done (weights version %d)", self.name, len(done), self.version)


    def _generate(self, rollout, p: dict) -> dict:
        """One leased group: {sample: Sample} of the lease's samples."""
        from verl_hpc.trainer.placement.elastic.coordinator import group_spec, lease_samples

        result = rollout.generate([p["prompt_ids"]], group_spec(self.spec, p["step"], p["prompt"]))
        return lease_samples(p["samples"], result, self.version)


def main(argv=None) -> int:
    from verl_hpc.errors import VerlHpcError
    from verl_hpc.runtime.errors import report

    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("VERL_HPC_LOGLEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s", datefmt="%H:%M:%S")
    if not argv or argv[0].startswith("-"):
        print("usage: python -m verl_hpc.submit --join RUN_DIR [--local] [overrides]", file=sys.stderr)
        return 2
    try:
        return Worker(argv[0], argv[1:]).run()
    except VerlHpcError as e:  # cannot join (30), a bad override (2)
        return report(e, 0)

