"""The rollout ranks' program in split placement: generate continuously, hand batches to the trainer.

    RolloutWorker(cfg, ctx, rollout, tokenizer).run()

Loop (the rollout leader decides from the mailbox; every rollout rank follows, since generation
and weight loads are collectives over the rollout group):
  1. stop?  -> leave (the trainer is done, or preempted and saved; every wait on the trainer, for
     its go, its weights, a version a generation request needs, watches the stop too);
  2. a checkpoint asks for our state? -> hand it over (data cursor, the batch in flight);
  3. newer weights published? -> load them (the only pause of generation); with
     partial_rollout=abort the unfinished samples of the batch in flight start again;
  4. a generation request from the trainer (validation)? -> answer it with the newest weights;
  5. batch s may start only with weights of version >= s - 1 - k (k = async_training.staleness):
     the trainer takes batch s at step s, whose policy is version s - 1; otherwise wait;
  6. generate one chunk (async_training.chunk_tokens per sample; 0 = whole responses) of the
     batch in flight; a finished batch goes to the trainer as `batch/<s>`.
Seeds: a whole-response batch s samples with `rollout.seed` for step s exactly as the colocated
trainer does (so k = 0 reproduces colocated training bitwise); chunk c of batch s with its own
seed per (step, chunk), request i of the chunk with request_seed(seed, i).

Elastic (placement.elastic, docs/elastic.md): steps 5 and 6 become the coordinator's. The leader
serves the joined workers (elastic/coordinator.py), opens the batches the newest weights may start,
hands the finished ones to the trainer in order, and leases prompt groups to this rollout group
like to any worker; the group generates each leased group with the group's own seed. (A group of
several replicas generates each lease on all of them: one rollout rank is the case built for.)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Dict, Optional

from verl_hpc.data import PromptLoader
from verl_hpc.resharding.bridge import WeightReceiver
from verl_hpc.rollout import SamplingSpec
from verl_hpc.rollout.prompts import check_prompts, fit_prompts
from verl_hpc.rollout.sampling import request_seed
from verl_hpc.runtime.split import POLL_S, STOP, GroupLostError
from verl_hpc.runtime.objects import broadcast_object
from verl_hpc.trainer.placement.elastic.coordinator import FIXED, Coordinator, group_spec, lease_samples
from verl_hpc.trainer.placement.elastic.rendezvous import FILE, Rendezvous, config_path
from verl_hpc.trainer.placement.inflight import BatchRecord, InFlight

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Decision:
    stop: bool = False
    pause: Optional[int] = None  # a checkpoint's state request number
    newest: int = -1  # the newest published weights
    request: Optional[tuple] = None  # (n, prompts, spec, min_version): generate for the trainer
    leases: Optional[list] = None  # elastic: the prompt groups this group generates now (payloads)


class RolloutWorker:
    def __init__(self, cfg, ctx, rollout, tokenizer):
        self.cfg, self.ctx, self.rollout = cfg, ctx, rollout
        self.world = ctx.split
        self.mb = self.world.mailbox
        a = cfg.async_training
        self.k, self.chunk, self.abort = a.staleness, a.chunk_tokens, a.partial_rollout == "abort"
        self.spec = SamplingSpec.from_config(cfg.rollout)
        self.leader = self.world.is_leader
        d = cfg.data
        self.loader = PromptLoader.from_config(d, tokenizer, d.wrap_plain_text) if self.leader else None
        self.weights = WeightReceiver(self.world, broadcast_object)
        self.next_index = 1
        self.inflight: Optional[InFlight] = None
        self.pauses = self.requests = 0
        self.stopped = False  # the trainer's STOP came while we waited on it (not at a decision)
        self._waiting_since = None
        self.stats = dict(gen_s=0.0, idle_s=0.0, load_s=0.0, tokens=0.0, load_bytes=0.0)
        # elastic: the leader coordinates workers that join as jobs of their own (elastic/coordinator.py)
        self.elastic = cfg.placement.elastic.enable
        self.coord = self.rendezvous = None
        if self.elastic and self.leader:
            self.coord = Coordinator(cfg, self.world.mailbox, epoch=int(time.time() * 1000),
                                     events=str(Path(cfg.trainer.output_dir) / FILE.parent / "events.jsonl"))
        self.next_open = 1  # elastic: the next batch of the stream to open (next_index: the next to hand over)

    # ---------------------------------------------------------------------------- the loop
    def run(self) -> dict:
        self._start()
        while not self.stopped:
            d = broadcast_object(self._decide() if self.leader else None)
            if d.stop:
                break
            if d.pause is not None:
                self._hand_over_state(d.pause)
                continue
            if d.newest > self.weights.version:
                self._load()
                if self.stopped:
                    break
            if d.request is not None:
                self._answer(d.request)
                continue
            if self.elastic:
                self._generate_leases(d.leases or [])
                continue
            need = max(0, self.next_index - 1 - self.k)
            if self.weights.version < need:
                self._idle(need)
                continue
            self._waiting_since = None
            self._generate_chunk()
        log.info("rollout: stopped by the trainer after batch %d (weights version %d)", self.next_index - 1,
                 self.weights.version)
        self._close_rendezvous("stopped")  # finished, or preempted (a requeued run opens a new epoch)
        return {"batches": self.next_index - 1, "version": self.weights.version}

    def _idle(self, need: int) -> None:
        """Waiting for the trainer's next update; past the timeout the training group is lost."""
        now = time.monotonic()
        self._waiting_since = self._waiting_since or now
        if now - self._waiting_since > self.world.timeout_s:
            raise GroupLostError(f"{self.world.name}: the training group published no weights of version "
                                 f">= {need} within {self.world.timeout_s:.0f} s (it holds {self.weights.version}); "
                                 "a training rank died or is stuck: see its log")
        time.sleep(POLL_S)
        self.stats["idle_s"] += time.monotonic() - now

    def _decide(self) -> Decision:
        mb = self.mb
        if mb.has(STOP):
            return Decision(stop=True)
        if mb.has(f"ctl/pause/{self.pauses}"):
            return Decision(pause=self.pauses)
        req = f"gen/request/{self.requests}"
        newest = self.weights.newest()
        leases = self._coordinate(newest) if self.elastic else None
        return Decision(newest=newest, request=mb.take(req) if mb.has(req) else None, leases=leases)

    def _start(self) -> None:
        """Wait for the trainer's go, with the state to continue from (a resumed run) or none; a
        trainer that stops (fails) before its go lets us go at once."""
        go = None
        if self.leader:
            go = ("go", self.mb.take("ctl/start")) if self.mb.wait("ctl/start", "the training group", unless=STOP) \
                else ("stop", None)
        how, state = broadcast_object(go)
        self.stopped = how == "stop"
        if state:
            self.next_index = state["next_index"]
            self.inflight = state["inflight"]
            if self.leader and state.get("loader") is not None:  # None: a checkpoint of a colocated run
                self.loader.load_state_dict(state["loader"])
            log.info("rollout: resumed at batch %d%s", self.next_index,
                     f" with {len(self.inflight.unfinished())} samples in flight" if self.inflight else "")
            if self.elastic:
                self.next_open = state.get("next_open", self.next_index)
                if self.leader:
                    self.coord.load_state_dict(state.get("elastic"))
        if self.elastic:
            self.next_open = max(self.next_open, self.next_index)
            if self.leader and not self.stopped:
                self._open_rendezvous()

    def _load(self) -> None:
        """The newest weights; `stopped` if the trainer stopped instead of sending them."""
        t0 = time.perf_counter()
        loaded = self.weights.load(self.rollout)
        if loaded is None:
            self.stopped = True
            return
        _, m = loaded
        self.stats["load_s"] += time.perf_counter() - t0
        self.stats["load_bytes"] += m["sync/bytes"]  # this rank's slices (sliced) or the whole model
        if self.inflight is not None and self.abort and self.inflight.prefix_length():
            n = self.inflight.abort_unfinished()
            log.debug("rollout: new weights (version %d): %d tokens in flight aborted", self.weights.version, n)

    # ---------------------------------------------------------------------------- generation
    def _new_batch(self) -> InFlight:
        return self._start_batch(self.next_index, broadcast_object(self.loader.next_batch() if self.leader else None))

    def _start_batch(self, index: int, prompts) -> InFlight:
        """Batch `index` of the stream: its prompts checked against the vocabulary and fitted."""
        fitted, truncated = fit_prompts(check_prompts(prompts.prompt_ids, self.rollout.vocab_size),
                                        self.rollout.max_prompt_length, self.rollout.prompt_overflow)
        return InFlight.start(index, prompts, fitted, truncated, self.spec.n)

    def _generate_chunk(self) -> None:
        if self.inflight is None:
            self.inflight = self._new_batch()
        b, t0 = self.inflight, time.perf_counter()
        result = self._extend(b)
        self.stats["gen_s"] += time.perf_counter() - t0
        self.stats["tokens"] += float(sum(len(r) for r in result.response_ids))
        if b.done:
            if self.leader:
                record = BatchRecord(b.index, b.groups(), dict(self.stats))
                self.mb.put(f"batch/{b.index}", record)
            self.stats = dict.fromkeys(self.stats, 0.0)
            self.next_index += 1
            self.inflight = None

    def _extend(self, b: InFlight):
        """One chunk of batch `b` with the current weights (its whole responses when chunk_tokens
        is 0), added to it; returns the chunk's RolloutResult."""
        v = self.weights.version
        step_spec = self.spec.for_step(b.index)
        if not self.chunk:  # whole responses: the colocated trainer's very call
            result = self.rollout.generate(b.fitted, step_spec)
            b.fill(result, v)
            return result
        rows = b.unfinished()
        have = b.prefix_length()
        spec = dataclasses.replace(step_spec, n=1, max_tokens=min(self.chunk, self.spec.max_tokens - have),
                                   seed=request_seed(step_spec.seed, "chunk", b.chunks) % 2**31)
        prompts = [b.fitted[i] + b.samples[i][j].tokens for i, j in rows]
        result = self.rollout.generate(prompts, spec, room=have)
        b.extend(rows, result, v, self.spec.max_tokens)
        return result

    def _answer(self, request) -> None:
        """A generation for the trainer (validation) with weights at least `min_version`."""
        n, prompts, spec, min_version = request
        while self.weights.version < min_version:  # the update it asks for may still be on its way
            newest, stop = broadcast_object((self.weights.newest(), self.mb.has(STOP)) if self.leader else None)
            if not stop and newest > self.weights.version:
                self._load()
            elif not stop:
                self._idle(min_version)  # bounded: a trainer that died after asking fails the job
            if stop or self.stopped:  # the trainer failed after asking: nobody takes the answer
                self.stopped = True
                return
        self._waiting_since = None
        result = self.rollout.generate(prompts, spec)
        if self.leader:
            self.mb.put(f"gen/result/{n}", result)
        self.requests += 1

    # ---------------------------------------------------------------------------- elastic workers
    def _open_rendezvous(self) -> None:
        """Leader: where workers find this run (its store, epoch, config), in the run's folder."""
        from verl_hpc.config import to_yaml

        run_dir = self.cfg.trainer.output_dir
        config_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
        config_path(run_dir).write_text(to_yaml(self.cfg))
        self.rendezvous = Rendezvous.create(run_dir, self.cfg, store=self.world.store_addr,
                                            epoch=self.coord.epoch).write()
        log.info("elastic rollout: workers join with `python -m verl_hpc.submit --join %s`", run_dir)

    def _close_rendezvous(self, status: str) -> None:
        if self.rendezvous is not None and self.rendezvous.status == "running":
            self.rendezvous.finish(status)

    def _coordinate(self, newest: int) -> list:
        """Leader, elastic: serve the workers, open the batches the weights allow, hand the finished
        ones to the trainer, and lease groups for this rollout group (payloads)."""
        c = self.coord
        c.service()
        # a batch s opens once some weights may start it (newest >= s - 1 - k), at most k + 2 ahead
        while self.next_open - 1 - self.k <= max(newest, 0) and len(c.batches) < self.k + 2:
            c.open(self._start_batch(self.next_open, self.loader.next_batch()))  # the leader's alone: no broadcast
            self.next_open += 1
        for batch in c.ready():
            stats = dict(self.stats, **c.metrics())
            self.mb.put(f"batch/{batch.index}", BatchRecord(batch.index, batch.groups(), stats))
            self.stats = dict.fromkeys(self.stats, 0.0)
            self.next_index = batch.index + 1
        return [c.payload(x) for x in c.lease(FIXED, self.weights.version)]

    def _generate_leases(self, payloads: list) -> None:
        """Elastic: this group's leased prompt groups, one generate call each (the group's own seed)."""
        if not payloads:
            t0 = time.perf_counter()
            time.sleep(POLL_S)
            self.stats["idle_s"] += time.perf_counter() - t0
            return
        for p in payloads:
            t0 = time.perf_counter()
            samples = self._generate_group(p)
            self.stats["gen_s"] += time.perf_counter() - t0
            self.stats["tokens"] += float(sum(len(x.tokens) for x in samples.values()))
            if self.leader:
                self.coord.finish(p["id"], samples)

    def _generate_group(self, p: dict) -> dict:
        """One leased group ({sample: Sample} of the lease's samples), with the group's own seed."""
        result = self.rollout.generate([p["prompt_ids"]], group_spec(self.spec, p["step"], p["prompt"]))
        return lease_samples(p["samples"], result, self.weights.version)

    # ---------------------------------------------------------------------------- checkpoints
    def state(self) -> Dict:
        s = {"next_index": self.next_index, "inflight": self.inflight,
             "loader": self.loader.state_dict() if self.leader else None, "version": self.weights.version}
        if self.elastic:
            s.update(next_open=self.next_open, elastic=self.coord.state_dict() if self.leader else None)
        return s

    def _hand_over_state(self, n: int) -> None:
        """A checkpoint's pause: our state to the trainer, then wait until it has it (or stops us)."""
        t0 = time.perf_counter()
        if self.leader:
            self.mb.take(f"ctl/pause/{n}")
            self.mb.put(f"rollout/state/{n}", self.state())
        go = None
        while go is None:  # the trainer answers as soon as it holds the state (before it writes it)
            go = broadcast_object(("stop" if self.mb.has(STOP) else "resume" if self.mb.has(f"ctl/resume/{n}")
                                   else None) if self.leader else None)
            if go is None:
                if time.perf_counter() - t0 > self.world.timeout_s:
                    raise GroupLostError(f"{self.world.name}: the training group took our state for checkpoint "
                                         f"{n} and said neither resume nor stop within {self.world.timeout_s:.0f} s; "
                                         "a training rank died or is stuck: see its log")
                time.sleep(POLL_S)
        if self.leader and go == "resume":
            self.mb.take(f"ctl/resume/{n}")
        self.pauses += 1
        self.stats["idle_s"] += time.perf_counter() - t0


def run(cfg, ctx) -> dict:
    """The rollout ranks' side of `trainer.job: rl` under placement.mode = split."""
    from verl_hpc.rollout import build_rollout
    from verl_hpc.trainer.roles import load_tokenizer, rollout_options

    worker = None
    try:
        tokenizer = load_tokenizer(cfg)
        with build_rollout(rollout_options(cfg), ctx) as rollout:
            worker = RolloutWorker(cfg, ctx, rollout, tokenizer)
            return worker.run()
    except BaseException as e:  # the trainer may be waiting on us: tell it, then fail as usual
        if worker is not None:
            worker._close_rendezvous("failed")  # elastic workers of this run leave
        ctx.split.leave_on_error(e)
        raise
