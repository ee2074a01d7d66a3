"""Fixtures shared by unit tests."""
import pytest


@pytest.fixture
def one_rank_world(tmp_path):
    """A one-rank gloo world in this process (real Megatron parallel state), torn down after."""
    import torch.distributed as dist

    from verl_hpc.parallel import cpu_compat, destroy_model_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
        cpu_compat.revert()
