"""A torn-down layout lets its process groups go.

Each gloo group keeps a transport thread that wakes about 100 times a second, two worker threads
and its store, for as long as anything references it. A process that builds layouts one after
another (the tests' in-process jobs) otherwise ends up with hundreds of such threads: measured
half-way through `make test`, 1,100 gloo threads in its two workers and 64,000 wake-ups a second.
What held them: the collective counter's group names, two globals that
Megatron's own destroy_model_parallel leaves set, and its RotaryEmbedding forward cache.
"""
import gc
import os
import weakref

import torch.distributed as dist


def _gloo_threads() -> int:
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop"
               for t in os.listdir("/proc/self/task"))


def _layout_groups(ps) -> list:
    getters = [ps.get_tensor_model_parallel_group, ps.get_data_parallel_group, ps.get_data_parallel_group_gloo,
               ps.get_pipeline_model_parallel_group, ps.get_context_parallel_group, ps.get_model_parallel_group]
    groups = [get() for get in getters]
    groups += [ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO]
    return [g for g in groups if g is not None]


def test_destroyed_layouts_release_every_group_and_its_threads(tmp_path):
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from verl_hpc.parallel import cpu_compat, destroy_model_parallel, init_model_parallel
    from verl_hpc.runtime import collectives

    collectives.install()
    before = _gloo_threads()
    refs = []
    for attempt in range(3):  # three jobs one after another in one process
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{attempt}", rank=0, world_size=1)
        try:
            init_model_parallel()  # names its groups for the collective counter
            groups = _layout_groups(ps)
            assert ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP is not None  # the one Megatron forgets
            assert collectives.group_name(ps.get_tensor_model_parallel_group()) == "tp"
            rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, cp_group=ps.get_context_parallel_group())
            rotary(4)  # cached by the module
            refs += [weakref.ref(g) for g in groups] + [weakref.ref(rotary)]
            del groups, rotary
        finally:
            destroy_model_parallel()
            dist.destroy_process_group()
            cpu_compat.revert()
        gc.collect()
        assert [r for r in refs if r() is not None] == [], f"job {attempt}: groups still held"
    assert _gloo_threads() == before
