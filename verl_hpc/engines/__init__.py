"""Training engines behind one interface (`TrainingEngine`, base.py) and the batch format they
take (batch.py). The Megatron-Core engine and its roles live in `verl_hpc.engines.megatron`
(megatron-core itself is imported only inside the functions that use it). The trainer builds
the roles from the job config (verl_hpc/trainer/roles.py: build_engine("actor", cfg, ctx)).
"""
from verl_hpc.engines.base import EngineState, GlobalCounts, LossFn, TrainingEngine
from verl_hpc.engines.batch import check_batch, get_response_mask, pack_sequences

__all__ = ["EngineState", "GlobalCounts", "LossFn", "TrainingEngine",
           "check_batch", "get_response_mask", "pack_sequences"]
