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


@pytest.fixture(scope="module")
def no_default_group_left():
    """For a module whose vLLM engines run in this process without a job's group: a default process
    group the first engine made (vLLM makes one where there is none) goes with the module, so that a
    later module's one-rank world can start on this pytest worker."""
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        dist.destroy_process_group()
