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
            data["store"] = tuple(data["store"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as e:
            raise ElasticJoinError(f"{path} is not a rendezvous file this version reads ({type(e).__name__}: {e})") from None

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
