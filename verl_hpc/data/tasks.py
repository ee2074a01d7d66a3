"""Several named tasks in one run (`data.tasks`): the tagged train/val sets and the weighted sampler.

Each task's files load into their own PromptDataset (same length filter as a single train set);
every row is tagged with its task in `extra["task"]` (which travels with the prompt through the
rollout, the rewards and the step's batch, so per-task metrics need no parallel bookkeeping) and,
when the task names one, gets the task's data_source (which picks the reward rule). The tasks are
concatenated in name order: the same order on every rank and on every resume.

`TaskSampler` draws each prompt from the task whose credit is highest (smooth weighted
round-robin: every draw adds each task's share to its credit, the chosen task pays 1). With fixed
weights every task stays within one sample of its exact share over any run of draws, as
MixtureSampler's deficit rule does; unlike that rule it has no memory of the whole run, so when
the task-weight scheduler changes the weights the new shares apply from the next draw instead of
first paying back a deficit built up under the old ones. The position is plain numbers: each
task's EpochSampler position, the credits and the weights (floats: JSON writes them exactly).
"""
from __future__ import annotations

import logging
import math
from typing import Dict, List, Mapping, Optional, Sequence

from verl_hpc.data.dataset import PromptDataset
from verl_hpc.data.errors import DataError
from verl_hpc.data.sampler import EpochSampler, Seed

log = logging.getLogger(__name__)
TASK_KEY = "task"  # extra[TASK_KEY]: the task a prompt belongs to


def task_of(extra: Mapping) -> str:
    return str(extra.get(TASK_KEY, ""))


def load_task_dataset(tasks: Mapping, tokenizer, data_cfg, wrap_plain_text: bool = True,
                      split: str = "train", tools=None, images=None) -> Optional[PromptDataset]:
    """The concatenated, tagged `split` (train | val) set of `tasks` ({name: TaskConfig}); None when
    no task has files for it."""
    parts: List[PromptDataset] = []
    for name in sorted(tasks):
        files = getattr(tasks[name], f"{split}_files")
        if not files:
            continue
        ds = PromptDataset.load(files, tokenizer, data_cfg.prompt_key, data_cfg.max_prompt_length,
                                data_cfg.overlong_prompts, wrap_plain_text, what=f"data.tasks.{name}.{split}_files",
                                tools=tools, images=images)
        for r in ds.records:
            r.extra = {**r.extra, TASK_KEY: name}
            if tasks[name].data_source:
                r.data_source = tasks[name].data_source
        log.info("task %s: %d %s prompts from %d file(s) (%d dropped as overlong)", name, len(ds), split,
                 len(files), ds.n_dropped)
        parts.append(ds)
    return PromptDataset.concat(parts) if parts else None


class TaskSampler:
    def __init__(self, groups: Mapping[str, Sequence[int]], weights: Mapping[str, float], seed: Seed = 1,
                 shuffle: bool = True, fingerprint: str = ""):
        missing = sorted(set(weights) - set(groups))
        if missing:
            raise DataError(f"data.tasks: task(s) {missing} have no training prompts")
        self.tasks = sorted(weights)  # sorted: ties break the same everywhere
        self.groups = {t: list(groups[t]) for t in self.tasks}
        self.samplers = {t: EpochSampler(len(self.groups[t]), f"{seed}:task:{t}", shuffle, f"{fingerprint}:{t}")
                         for t in self.tasks}
        self.credits = {t: 0.0 for t in self.tasks}
        self.counts = {t: 0 for t in self.tasks}  # draws per task, for the logs
        self.fingerprint = fingerprint
        self.set_weights(weights)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        if sorted(weights) != self.tasks:
            raise DataError(f"task weights for {sorted(weights)}, but the tasks are {self.tasks}")
        bad = {t: w for t, w in weights.items() if not (w >= 0 and math.isfinite(w))}
        if bad or sum(weights.values()) <= 0:
            raise DataError(f"task weights must be finite, >= 0, with a positive sum; got {dict(weights)}")
        self.weights = {t: float(weights[t]) for t in self.tasks}
        total = sum(self.weights.values())
        self.shares = {t: self.weights[t] / total for t in self.tasks}

    def _pick(self) -> str:
        live = [t for t in self.tasks if self.shares[t] > 0]
        for t in live:
            self.credits[t] += self.shares[t]
        best = max(live, key=lambda t: (self.credits[t], -self.tasks.index(t)))
        self.credits[best] -= 1.0
        return best

    def next_indices(self, count: int) -> List[int]:
        out = []
        for _ in range(count):
            t = self._pick()
            self.counts[t] += 1
            out.append(self.groups[t][self.samplers[t].next_indices(1)[0]])
        return out

    def state_dict(self) -> Dict:
        return {"kind": "tasks", "fingerprint": self.fingerprint, "weights": dict(self.weights),
                "credits": dict(self.credits), "counts": dict(self.counts),
                "samplers": {t: self.samplers[t].state_dict() for t in self.tasks}}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        if state.get("kind") != "tasks":
            raise DataError(f"sampler state: saved by a {state.get('kind')!r} sampler, but this run uses "
                            "data.tasks; resume with the data settings the checkpoint was made with")
        if sorted(state["weights"]) != self.tasks:
            raise DataError(f"sampler state: saved for data.tasks {sorted(state['weights'])}, but this run has "
                            f"{self.tasks}; resume with the same tasks")
        for t in self.tasks:
            self.samplers[t].load_state_dict(state["samplers"][t], strict)
        self.set_weights({t: float(state["weights"][t]) for t in self.tasks})
        self.credits = {t: float(state["credits"][t]) for t in self.tasks}
        self.counts = {t: int(state["counts"][t]) for t in self.tasks}
