"""`data:` prompt files, lengths and batch sizes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List

from verl_hpc.config.fields import MAX_BATCH, MAX_TOKENS, Section, opt, section
from verl_hpc.config.sections.tasks import TaskConfig, TaskWeightsConfig, task_problems


@dataclass
class DataConfig(Section):
    train_files: List[str] = opt([], "parquet / jsonl prompt files")
    val_files: List[str] = opt([], "parquet / jsonl validation prompt files")
    prompt_key: str = opt("prompt", "column holding the prompt (text or chat messages)")
    max_prompt_length: int = opt(256, "tokens", check=f"[1, {MAX_TOKENS}]")
    max_response_length: int = opt(128, "tokens generated per response at most", check=f"[1, {MAX_TOKENS}]")
    train_batch_size: int = opt(8, "prompts per step (each gets rollout.n responses)", check=f"[1, {MAX_BATCH}]")
    val_batch_size: int = opt(64, "validation prompts per generate call", check=f"[1, {MAX_BATCH}]")
    shuffle: bool = opt(True, "shuffle the prompts every epoch")
    seed: int = opt(1, "seed of the data order")
    overlong_prompts: str = opt("drop", "prompts longer than max_prompt_length", choices=("drop", "error"))
    mixture: Dict[str, float] = opt({}, "data_source -> sampling weight, e.g. {gsm8k: 2.0, math: 1.0}")
    tasks: Dict[str, TaskConfig] = opt({}, "named tasks trained at once, each with train_files, val_files, weight "
                                            "and data_source (replaces train_files/val_files/mixture)")
    task_weights: TaskWeightsConfig = section(TaskWeightsConfig, "how data.tasks weights change during the run")
    wrap_plain_text: bool = opt(True, "plain-text prompts go through the tokenizer's chat template")
    sft_files: List[str] = opt([], "trainer.job=sft: parquet / jsonl rows with prompt and response columns")
    response_key: str = opt("response", "SFT: column holding the target response")
    preference_files: List[str] = opt([], "trainer.job=dpo: training rows (prompt + chosen/rejected, or KTO rows)")
    preference_val_files: List[str] = opt([], "trainer.job=dpo: held-out rows for the preference metrics")
    chosen_key: str = opt("chosen", "paired preference losses: the preferred response column")
    rejected_key: str = opt("rejected", "paired preference losses: the dispreferred response column")
    completion_key: str = opt("completion", "KTO: the completion column")
    label_key: str = opt("label", "KTO: boolean column, true = desirable")

    @property
    def max_sequence_length(self) -> int:
        return self.max_prompt_length + self.max_response_length

    def check(self, job) -> List[str]:
        p = []
        weights = self.mixture.values()
        # NaN passes both comparisons, and the sampler's draw would fail on it (inf too)
        if not all(w >= 0 and math.isfinite(w) for w in weights) or (weights and sum(weights) <= 0):
            p.append(f"data.mixture: weights must be finite, >= 0, with a positive sum, got {self.mixture}")
        if job.trainer.job == "rl" and not self.train_files and not self.tasks:
            p.append(f"data.train_files: empty, but trainer.job = {job.trainer.job} needs at least one prompt file "
                     "(or data.tasks)")
        if job.trainer.job == "dpo" and not self.preference_files:
            p.append("data.preference_files: empty, but trainer.job = dpo needs at least one file")
        if job.trainer.job == "sft" and not self.sft_files:
            p.append("data.sft_files: empty, but trainer.job = sft needs at least one file with prompt and "
                     f"{self.response_key} columns")
        return p + task_problems(job) + self._step_split(job)

    def _step_split(self, job) -> List[str]:
        layout, n = job.layout, job.sequences_per_example
        if (job.trainer.job == "smoke" or not layout.tiles or min(self.train_batch_size, n) <= 0
                or max(self.train_batch_size, n) > MAX_BATCH):
            return []  # smoke has no batches; a broken layout or size is reported on its own
        if self.train_batch_size * n > MAX_BATCH:
            return [f"data.train_batch_size * rollout.n = {self.train_batch_size} * {n} = "
                    f"{self.train_batch_size * n} responses per step: must be at most {MAX_BATCH}"]
        if (self.train_batch_size * n) % layout.dp:
            return [f"data.train_batch_size * rollout.n = {self.train_batch_size} * {n} = "
                    f"{self.train_batch_size * n} responses per step is not divisible by {layout.dp_words}"]
        return []
