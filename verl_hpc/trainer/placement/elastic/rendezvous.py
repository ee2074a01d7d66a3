"""How a rollout worker finds a running elastic run: a small JSON file in the run's folder on the
shared filesystem (no daemon, no Ray), written by the run and read by every worker job.

    Rendezvous.create(run_dir, cfg, store=(host, port), epoch=requeues).write()   # the run, at start
    rdv.finish("completed")                                                      # the run, at its end
    rdv = Rendezvous.join(run_dir, worker_cfg)   # a worker: the run's address, or ElasticJoinError

`<run_dir>/elastic/rendezvous.json` holds the run's store address, its epoch (a requeued run is a
new epoch: workers of the old one leave), its status (running | completed | stopped | failed) and
the parts of its config a worker must share: what it generates with (the model, tokenizer and
dtype, the rollout section but its engine-local knobs, the prompt and response lengths). A worker
brought up with its own config is refused when one of those differs, naming the first field;
one that finds no file, or a run that has ended, is refused naming that. The file is replaced
atomically (written aside, then renamed), so a worker never reads half of it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from verl_hpc.errors import VerlHpcError

FILE = Path("elastic") / "rendezvous.json"
CONFIG = Path("elastic") / "config.yaml"  # the run's resolved config, which workers generate with
RUNNING = "running"
# the rollout fields a worker may set for its own engine (its GPUs and memory, not the samples)
LOCAL_ROLLOUT = ("tp", "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager",
                 "sleep_between_phases", "sleep_level", "enable_chunked_prefill", "max_num_batched_tokens", "engine")


def config_path(run_dir) -> Path:
    return Path(run_dir) / CONFIG


class ElasticJoinError(VerlHpcError, RuntimeError):
    """A rollout worker cannot join the run it was pointed at (not an elastic run, ended, another config)."""

    exit_code, kind = 30, "elastic join"


def shared_fields(cfg) -> Dict[str, object]:
    """The config values a worker must share with the run, as `section.field` -> value."""
    out: Dict[str, object] = {}
    for field in ("path", "tokenizer_path", "dtype", "trust_remote_code"):
        out[f"model.{field}"] = getattr(cfg.model, field)
    for field in ("max_prompt_length", "max_response_length"):
        out[f"data.{field}"] = getattr(cfg.data, field)
    for f in dataclasses.fields(cfg.rollout):
        if f.name not in LOCAL_ROLLOUT:
            value = getattr(cfg.rollout, f.name)
            if dataclasses.is_dataclass(value):  # a nested section (rollout.speculative): its fields, as JSON keeps them
                value = dataclasses.asdict(value)
            out[f"rollout.{f.name}"] = list(value) if isinstance(value, (list, tuple)) else value
    return out


@dataclasses.dataclass
class Rendezvous:
    run_dir: str
    store: Tuple[str, int]
    epoch: int
    status: str
    shared: Dict[str, object]
    started: float
    ended: Optional[float] = None

    @classmethod
    def create(cls, run_dir, cfg, *, store: Tuple[str, int], epoch: int) -> "Rendezvous":
        return cls(str(run_dir), (store[0], int(store[1])), epoch, RUNNING, shared_fields(cfg), time.time())

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / FILE

    def write(self) -> "Rendezvous":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1, default=str))
        os.replace(tmp, self.path)
        return self

    def finish(self, status: str) -> None:
        self.status, self.ended = status, time.time()
        self.write()

    @classmethod
    def read(cls, run_dir) -> "Rendezvous":
        path = Path(run_dir) / FILE
        if not path.is_file():
            raise ElasticJoinError(f"{run_dir} has no {FILE}: it is not an elastic run (placement.mode = split with "
                                   "elastic rollout workers), or it has not started yet")
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError) as e:
            raise ElasticJoinError(f"{path} is not a rendezvous file this version reads ({type(e).__name__}: {e})") from None
        problem = _field_problem(data)
        if problem:  # a damaged or hand-edited file: one line naming the field, not a traceback later
            raise ElasticJoinError(f"{path}: {problem}; the run writes this file itself: a damaged one means "
                                   "the run must be restarted (or the file restored)")
        data["store"] = (data["store"][0], int(data["store"][1]))
        return cls(**data)

    def check_store(self, timeout_s: float = 10.0) -> None:
        """ElasticJoinError unless the run's store answers at its address (a run that died without
        marking its rendezvous leaves 'running' behind and no one listening)."""
        import socket

        host, port = self.store
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as e:
            raise ElasticJoinError(f"{self.path}: the run's store at {host}:{port} (field 'store') does not answer "
                                   f"({type(e).__name__}: {e.strerror or e}); the run is gone although its status "
                                   f"says {self.status!r}: there is nothing to join") from None

    @classmethod
    def join(cls, run_dir, worker_cfg=None) -> "Rendezvous":
        """The run's rendezvous for a worker, or ElasticJoinError naming why it cannot join."""
        rdv = cls.read(run_dir)
        if rdv.status != RUNNING:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rdv.ended)) if rdv.ended else "an unknown time"
            raise ElasticJoinError(f"the run in {run_dir} has ended ({rdv.status} at {when}): there is nothing to join")
        if worker_cfg is not None:
            mine = shared_fields(worker_cfg)
            for key, value in rdv.shared.items():
                if key in mine and _normal(mine[key]) != _normal(value):
                    raise ElasticJoinError(f"the worker's {key} = {mine[key]!r} differs from the run's {value!r} "
                                           f"({run_dir}): a worker generates with the run's model and sampling; "
                                           "join without a config of your own, or with the run's")
        return rdv


def _normal(value):
    """JSON's view of a value (tuples are lists there), so that a read value compares with a live one."""
    return json.loads(json.dumps(value, default=str))


STATUSES = (RUNNING, "completed", "stopped", "failed")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field_problem(data) -> str:
    """'' for a rendezvous file's fields as the run writes them, else what is wrong with the first."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    missing = [k for k in ("run_dir", "store", "epoch", "status", "shared", "started") if k not in data]
    if missing:
        return f"no field {missing[0]!r}"
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(Rendezvous)})
    if unknown:
        return f"unknown field {unknown[0]!r}"
    store = data["store"]
    if not (isinstance(store, list) and len(store) == 2 and isinstance(store[0], str) and store[0]):
        return f"field 'store' is {store!r}; expected [host, port], e.g. [\"node17\", 29501]"
    port = store[1]
    if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
        return f"field 'store' has port {port!r}; expected an integer in 1..65535"
    if not (isinstance(data["epoch"], int) and not isinstance(data["epoch"], bool) and data["epoch"] >= 0):
        return f"field 'epoch' is {data['epoch']!r}; expected an integer >= 0"
    if data["status"] not in STATUSES:
        return f"field 'status' is {data['status']!r}; expected one of {', '.join(STATUSES)}"
    if not isinstance(data["shared"], dict):
        return f"field 'shared' is {type(data['shared']).__name__}; expected an object of config fields"
    if not _number(data["started"]):
        return f"field 'started' is {data['started']!r}; expected a number (seconds since 1970)"
    if data.get("ended") is not None and not _number(data["ended"]):
        return f"field 'ended' is {data['ended']!r}; expected a number (seconds since 1970) or null"
    if not isinstance(data["run_dir"], str):
        return f"field 'run_dir' is {data['run_dir']!r}; expected the run's folder"
    return ""
