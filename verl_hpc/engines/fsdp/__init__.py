"""The second training engine: any Hugging Face model, as transformers builds it, sharded with
PyTorch FSDP2 (`fully_shard` over a DeviceMesh), behind the same `TrainingEngine` contract and the
same checkpoint coordinates as the Megatron engine.

    engine.py     FsdpEngine: forward, train_step, export, state (micro-batches as the Megatron engine)
    microbatch.py one micro-batch's rows and model inputs (plain, packed, images, a sequence slice)
    scoring.py    the model on a micro-batch and its per-token outputs (whole logits, or chunked: head.py)
    ulysses.py    fsdp.sp: Ulysses sequence parallelism (the regrouped attention, the slice's outputs)
    build.py      the model from the folder (meta on every rank, rank 0's weights broadcast shard by
                  shard), the mesh (FSDP or HSDP), fully_shard per decoder layer, precision, recompute,
                  the checks of the options (check_fsdp_options)
    optim.py      AdamW, the LR schedule (Megatron's state keys), the guarded, clipped step
    state.py      checkpoint slabs in Megatron's names for mapped families, HF names otherwise
    export.py     the weight stream (full HF tensors); holdings.py: this rank's shards, for the sliced sync
    lora.py       LoRA through PEFT: adapters on the language model, PEFT's names and files

torch.distributed.fsdp and transformers are imported here at module level only by engine.py's
callers that build an engine; importing verl_hpc does not import this package.
"""
from verl_hpc.engines.fsdp.engine import FsdpEngine

__all__ = ["FsdpEngine"]
