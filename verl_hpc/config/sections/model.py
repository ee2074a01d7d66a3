"""`model:` the Hugging Face model the job trains and serves."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List

from verl_hpc.config.fields import Section, opt


@dataclass
class ModelConfig(Section):
    path: str = opt("", "Hugging Face model folder (config.json, tokenizer, safetensors)")
    tokenizer_path: str = opt("", "tokenizer folder", auto="model.path")
    dtype: str = opt("float32", "bfloat16 on GPUs; float32 for exact CPU tests",
                     choices=("float32", "bfloat16", "float16"))
    trust_remote_code: bool = opt(False, "let transformers run code shipped with the model")
    fp8: bool = opt(False, "Transformer Engine FP8 training; GPU only")

    def check(self, job) -> List[str]:
        p = []
        if job.slurm.gpus_per_node == 0 and self.fp8:
            p.append("model.fp8 needs GPUs (Transformer Engine), but slurm.gpus_per_node = 0 (a CPU job)")
        if job.trainer.job in ("rl", "sft") and not self.path:
            p.append(f"model.path: empty, but trainer.job = {job.trainer.job} needs a Hugging Face model folder")
        return p

    def resolve(self, job) -> None:
        self.tokenizer_path = self.tokenizer_path or self.path

    def folder_problems(self) -> List[str]:
        """Checks that read the file system (skipped by `validate(check_model=False)`)."""
        tok = self.tokenizer_path
        if tok and tok != self.path and not Path(tok).is_dir():
            return [f"model.tokenizer_path: no such folder '{tok}'"]
        return []
