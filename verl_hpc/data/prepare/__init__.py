"""Dataset preprocessors: public task formats -> the prompt parquet files the trainer reads.

    python -m verl_hpc.data.prepare gsm8k IN.jsonl OUT.parquet
    python -m verl_hpc.data.prepare math IN.jsonl OUT.parquet
    python -m verl_hpc.data.prepare synthetic OUT_DIR --n-train N --n-val M --seed S
    python -m verl_hpc.data.prepare visual OUT_DIR --n-train N --n-val M --seed S --sft-noise P

Every output row has `prompt` (plain text; the chat template is applied when the data is loaded,
see verl_hpc.data.templates), `data_source`, `ground_truth` and `extra`; the visual task's rows also carry `images` (PNG bytes)
and an `<image>` placeholder in the prompt.
"""
