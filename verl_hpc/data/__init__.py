"""Prompt data: files -> validated records -> chat-templated token ids -> resumable batches.

    train = PromptLoader.from_config(cfg.data, tokenizer)   # rank 0 only; it samples the global batch
    batch = train.next_batch()                               # PromptBatch
    state = train.state_dict(); train.load_state_dict(state) # plain ints/strings, for the checkpoint
    val = load_val_dataset(cfg.data, tokenizer)
    for vb in val_batches(val, cfg.data.val_batch_size): ...

Preprocessors: `python -m verl_hpc.data.prepare gsm8k|math|synthetic ...`.
"""
from verl_hpc.data.batch import PromptBatch
from verl_hpc.data.dataset import PromptDataset
from verl_hpc.data.errors import DataError
from verl_hpc.data.loader import PromptLoader, load_val_dataset, val_batches
from verl_hpc.data.records import PromptRecord, load_records, read_rows
from verl_hpc.data.sampler import EpochSampler, MixtureSampler
from verl_hpc.data.templates import encode_prompts, render_prompt

__all__ = ["DataError", "EpochSampler", "MixtureSampler", "PromptBatch", "PromptDataset", "PromptLoader",
           "PromptRecord", "encode_prompts", "load_records", "load_val_dataset", "read_rows", "render_prompt",
           "val_batches"]
