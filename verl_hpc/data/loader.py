"""The trainer's view of the data: `next_batch()` for training, `val_batches()` for validation.

Rank 0 builds the loader and samples the global batch of data.train_batch_size prompts; the
trainer broadcasts or scatters it (there is no per-rank sharding here, see sampler.py). The
loader's position is `state_dict()`: nested dicts of ints and strings, saved with the checkpoint.

    train = PromptLoader.from_config(cfg.data, tokenizer)
    batch = train.next_batch()                      # PromptBatch of train_batch_size prompts
    val = load_val_dataset(cfg.data, tokenizer)    # once; None without data.val_files
    for vb in val_batches(val, cfg.data.val_batch_size): ...
"""
from __future__ import annotations

import logging
from typing import Dict, Iterator, Mapping, Optional, Union

from verl_hpc.data.batch import PromptBatch
from verl_hpc.data.dataset import PromptDataset
from verl_hpc.data.errors import DataError
from verl_hpc.data.sampler import EpochSampler, MixtureSampler
from verl_hpc.data.tasks import TaskSampler, load_task_dataset

log = logging.getLogger(__name__)


class PromptLoader:
    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int = 1, shuffle: bool = True,
                 mixture: Optional[Mapping[str, float]] = None, task_weights: Optional[Mapping[str, float]] = None):
        """task_weights: {task: weight} for a dataset tagged by verl_hpc.data.tasks (data.tasks)."""
        if batch_size <= 0:
            raise DataError(f"a batch of {batch_size} prompts: the batch size (data.train_batch_size) must be > 0")
        self.dataset, self.batch_size = dataset, batch_size
        fp = dataset.fingerprint()
        self.sampler: Union[EpochSampler, MixtureSampler, TaskSampler]
        if task_weights:
            self.sampler = TaskSampler(dataset.indices_by_task(), dict(task_weights), seed, shuffle, fp)
        elif mixture:
            self.sampler = MixtureSampler(dataset.indices_by_source(), dict(mixture), seed, shuffle, fp)
        else:
            self.sampler = EpochSampler(len(dataset), seed, shuffle, fp)
        self.step = 0  # batches served; part of the state so a resumed loader can be checked

    @classmethod
    def from_config(cls, data_cfg, tokenizer, wrap_plain_text: bool = True, tools=None,
                    images=None) -> "PromptLoader":
        """tools: {name: schema} of a multi_turn job; images: ImagePrompts (PromptDataset.load)."""
        if data_cfg.tasks:
            from verl_hpc.config.sections.tasks import task_specs

            specs = task_specs(data_cfg)
            dataset = load_task_dataset(specs, tokenizer, data_cfg, wrap_plain_text, "train", tools=tools,
                                        images=images)
            return cls(dataset, data_cfg.train_batch_size, data_cfg.seed, data_cfg.shuffle,
                       task_weights={n: t.weight for n, t in specs.items()})
        dataset = PromptDataset.load(data_cfg.train_files, tokenizer, data_cfg.prompt_key, data_cfg.max_prompt_length,
                                     data_cfg.overlong_prompts, wrap_plain_text, what="data.train_files", tools=tools,
                                     images=images)
        log.info("train set: %d prompts from %d file(s) (%d dropped as overlong)", len(dataset),
                 len(data_cfg.train_files), dataset.n_dropped)
        return cls(dataset, data_cfg.train_batch_size, data_cfg.seed, data_cfg.shuffle, dict(data_cfg.mixture))

    @property
    def steps_per_epoch(self) -> int:
        """Batches per pass over the train set (rounded up; batches run on across epochs)."""
        return -(-len(self.dataset) // self.batch_size)

    def set_task_weights(self, weights: Mapping[str, float]) -> None:
        """data.tasks: the weights the next batches are drawn with (the task-weight scheduler's)."""
        if not isinstance(self.sampler, TaskSampler):
            raise DataError("task weights need data.tasks (this loader samples without tasks)")
        self.sampler.set_weights(weights)

    def next_batch(self) -> PromptBatch:
        self.step += 1
        return self.dataset.batch(self.sampler.next_indices(self.batch_size))

    def state_dict(self) -> Dict:
        return {"step": self.step, "batch_size": self.batch_size, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        if "split_async" in state:  # the rollout group's stream, batches ahead of the trainer included
            raise DataError("loader state: the checkpoint was written by a split placement run (its data stream "
                            "ran ahead on the rollout ranks, with batches in flight); resume it with "
                            "placement.mode = split")
        if strict and int(state["batch_size"]) != self.batch_size:
            # the sampler would resume at the right prompt, but step counts would stop matching epochs
            raise DataError(f"loader state: saved with data.train_batch_size = {state['batch_size']}, this run "
                            f"has {self.batch_size}; resume with the same value (or strict=False)")
        self.sampler.load_state_dict(state["sampler"], strict)
        self.step = int(state["step"])


def val_batches(dataset: PromptDataset, batch_size: int) -> Iterator[PromptBatch]:
    """Every val prompt once, in file order, in chunks of batch_size (the last one may be smaller)."""
    if batch_size <= 0:
        raise DataError(f"a batch of {batch_size} prompts: the batch size (data.val_batch_size) must be > 0")
    for start in range(0, len(dataset), batch_size):
        yield dataset.batch(range(start, min(start + batch_size, len(dataset))))


def load_val_dataset(data_cfg, tokenizer, wrap_plain_text: bool = True, tools=None,
                     images=None) -> Optional[PromptDataset]:
    """The val set of data.val_files, or None when there is none; same length filter as training."""
    if data_cfg.tasks:
        from verl_hpc.config.sections.tasks import task_specs

        return load_task_dataset(task_specs(data_cfg), tokenizer, data_cfg, wrap_plain_text, "val", tools=tools,
                                 images=images)
    if not data_cfg.val_files:
        return None
    return PromptDataset.load(data_cfg.val_files, tokenizer, data_cfg.prompt_key, data_cfg.max_prompt_length,
                              data_cfg.overlong_prompts, wrap_plain_text, what="data.val_files", tools=tools,
                              images=images)

