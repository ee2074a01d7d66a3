"""Training engines behind one interface (`TrainingEngine`, base.py) and the batch format they
take (batch.py). The Megatron-Core engine and its roles live in `verl_hpc.engines.megatron`
(megatron-core itself is imported only inside the functions that use it).

    from verl_hpc.engines import build_engine
    actor = build_engine("actor", cfg, ctx)
"""
from verl_hpc.engines.base import EngineState, GlobalCounts, LossFn, TrainingEngine
from verl_hpc.engines.batch import check_batch, get_response_mask, pack_sequences


def build_engine(role: str, cfg, ctx=None, **kwargs):
    """See verl_hpc.engines.megatron.roles.build_engine."""
    from verl_hpc.engines.megatron.roles import build_engine as _build

    return _build(role, cfg, ctx, **kwargs)


__all__ = ["EngineState", "GlobalCounts", "LossFn", "TrainingEngine", "build_engine",
           "check_batch", "get_response_mask", "pack_sequences"]
