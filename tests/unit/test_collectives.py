"""Named and counted collectives (runtime/collectives.py), the per-stage byte metrics of the stage
timer, the placement summary, and the scaling formulas against hand counts for the tiny model."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from verl_hpc.parallel.placement import Placement
from verl_hpc.runtime import collectives
from verl_hpc.tracking.timers import StageTimer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    collectives.install(timeout_s=7)
    collectives.reset()
    yield
    dist.destroy_process_group()


def test_counts_payload_per_collective_and_group(world):
    t = torch.ones(10)
    dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()
    out = torch.empty(10, dtype=torch.float64)
    dist.all_gather_into_tensor(out, torch.ones(10, dtype=torch.float64))
    g = dist.new_group([0])
    collectives.name_group(g, "tp")
    dist.broadcast(t, 0, group=g)
    assert collectives.counts() == {("all_reduce", "world"): (2, 80), ("all_gather_into_tensor", "world"): (1, 80),
                                    ("broadcast", "tp"): (1, 40)}


def test_functional_all_to_all_counted_forward_and_backward(world):
    """The Ulysses regrouping calls torch's functional all_to_all (not the torch.distributed
    namespace): its forward payload and its backward's (the output's gradient) are counted."""
    from torch.distributed import _functional_collectives as funcol

    g = dist.new_group([0])
    collectives.name_group(g, "sp")
    x = torch.ones(3, 5, requires_grad=True)
    out = funcol.wait_tensor(funcol.all_to_all_single_autograd(x * 2, None, None, g))
    assert collectives.counts() == {("all_to_all_single", "sp"): (1, 60)}
    out.sum().backward()
    assert collectives.counts() == {("all_to_all_single", "sp"): (2, 120)}
    assert torch.equal(x.grad, torch.full((3, 5), 2.0))
    with torch.no_grad():  # a forward without autograd: no backward to count
        funcol.wait_tensor(funcol.all_to_all_single_autograd(torch.ones(4, 2), None, None, g))
    assert collectives.counts() == {("all_to_all_single", "sp"): (3, 152)}


def test_failure_names_collective_group_rank_and_timeout(world):
    def broken(*args, **kwargs):
        raise RuntimeError("Timed out waiting 7000ms for recv operation to complete")

    wrapped = collectives._wrap("all_reduce", broken)
    with pytest.raises(collectives.CollectiveError,
                       match=r"collective all_reduce on group 'world' \(ranks \[0\]\) failed on rank 0 after "
                             r"[\d.]+s \(collective timeout 7s\): RuntimeError: Timed out"):
        wrapped(torch.ones(1))


def test_stage_timer_reports_bytes_per_stage(world):
    timer = StageTimer(comm=collectives.counts)
    with timer("sync"):
        dist.all_reduce(torch.ones(4))
    with timer("adv"):
        pass
    m = timer.pop()
    assert m["comm_bytes/sync/all_reduce@world"] == 16 and m["comm_calls/sync/all_reduce@world"] == 1
    assert not any(k.startswith("comm_bytes/adv") for k in m)
    assert not any(k.startswith("comm_") for k in timer.pop())  # reset by pop


def test_placement_summary_and_split_tp_warning_flag():
    ok = Placement(hosts=("node1", "node1", "node2", "node2"), tp_groups=((0, 1), (2, 3)), dp_groups=((0, 2), (1, 3)))
    assert ok.tp_inside_nodes and "TP groups each inside one node" in ok.describe()
    assert "DP groups span up to 2 node(s)" in ok.describe()
    split = Placement(hosts=("node1", "node2"), tp_groups=((0, 1),), dp_groups=((0,), (1,)))
    assert not split.tp_inside_nodes and "SPLIT ACROSS NODES" in split.describe()


def test_formulas_match_hand_counts_for_the_tiny_llama():
    from scaling_formulas import Layout, Model, dist_opt_buffer, resharding_bytes

    m = Model(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, head_dim=32, vocab=500)
    # by hand: embedding 500x128, per layer qkv 128x256 + o 128x128 + gate/up 128x512 + down 256x128
    # + 2 norms, final norm, untied head
    assert m.hf_params() == 64000 + 2 * (32768 + 16384 + 65536 + 32768 + 256) + 128 + 64000
    # TP2 rank: vocab padded to 512, halves of every split weight; 213632 is a multiple of 128
    assert dist_opt_buffer(m, Layout(tp=2, dp=2)) == 512 * 64 * 2 + 2 * (73728 + 256) + 128
    assert resharding_bytes(m, Layout(tp=2), 4) == {("all_gather", "tp"): (512 * 128 * 2 + 2 * 147456) * 4}
    assert dist_opt_buffer(m, Layout(dp=3)) % 384 == 0  # padded to lcm(3, 128)


def test_ulysses_alltoall_formula_by_hand():
    from scaling_formulas import Model, ulysses_alltoall_bytes, ulysses_kv_repeats

    m = Model(hidden=128, layers=2, ffn=256, heads=4, kv_heads=2, head_dim=32, vocab=500)
    assert ulysses_kv_repeats(m, 2) == 1 and ulysses_kv_repeats(m, 4) == 2
    # sp = 4, micro-batches of 1 x 8 and 2 x 4 tokens (fp32): per layer q hands 1*4*2*32*4 + 2*4*1*32*4
    # = 2048 bytes, the output as many, k and v (2 KV heads repeated twice: 4) 2048 each; 2 layers
    mbs = [(1, 8), (2, 4)]
    assert ulysses_alltoall_bytes(m, 4, mbs, 4, backward=False) == 2 * 4 * 2048
    assert ulysses_alltoall_bytes(m, 4, mbs, 4, backward=True) == 2 * 2 * 4 * 2048
    assert ulysses_alltoall_bytes(m, 4, mbs, 4, backward=True, recompute=True) == 3 * 2 * 4 * 2048
    # sp = 2: the KV heads split (no repeat): k, v hand 2*(S/2)*32*4 per row
    assert ulysses_alltoall_bytes(m, 2, [(1, 8)], 2, backward=False) == 2 * (2 * 4 * 4 + 2 * 2 * 4) * 32 * 2
    assert ulysses_alltoall_bytes(m, 1, mbs, 4, backward=True) == 0


def test_async_collectives_inside_a_coalescing_block_run_as_torch_runs_them(world):
    """Megatron's DDP with overlap_grad_reduce issues async collectives inside torch's
    _coalescing_manager, where torch returns a placeholder Work whose every attribute access raises.
    The wrapper must hand it back untouched: the block ends, cm.wait() runs the coalesced
    all-reduce, and no coalescing state is left on the group (a leftover op list would queue every
    later collective of that group without running it)."""
    from torch.distributed.distributed_c10d import _coalescing_manager, _world

    tensors = [torch.full((4,), float(i)) for i in range(3)]
    with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t, async_op=True)
    cm.wait()
    assert not _world.pg_coalesce_state
    assert collectives.counts() == {("all_reduce", "world"): (3, 48)}
    dist.all_reduce(tensors[0])  # the group is usable again: a plain collective runs at once
    assert collectives.counts() == {("all_reduce", "world"): (4, 64)}


def test_the_wrapper_returns_torchs_own_work_object(world):
    """FSDP2 decides whether to wait by isinstance(work, Work) and C++ takes the Work itself: an
    async collective returns exactly torch's object."""
    work = dist.all_reduce(torch.ones(2), async_op=True)
    assert type(work) is dist.distributed_c10d.Work or isinstance(work, dist.distributed_c10d.Work)
    assert type(work).__module__.startswith("torch")
    work.wait()
    assert dist.all_reduce(torch.ones(2)) is None


def test_every_collective_of_the_installed_torch_is_counted(world):
    """Every torch.distributed function that takes a group and async_op (a collective) is wrapped:
    a torch upgrade that adds a collective path (FSDP2 moved to all_gather_single /
    reduce_scatter_single in torch 2.13) fails here instead of going uncounted."""
    import inspect

    collective = [n for n in dir(dist) if not n.startswith("__") and inspect.isfunction(getattr(dist, n, None))
                  and {"group", "async_op"} <= set(inspect.signature(getattr(dist, n)).parameters)]
    assert "all_reduce" in collective and len(collective) >= 10
    unwrapped = [n for n in collective if not hasattr(getattr(dist, n), "__wrapped_collective__")]
    assert not unwrapped, f"collectives runtime/collectives.py does not wrap on torch {torch.__version__}: {unwrapped}"


def test_fsdp2_collectives_are_counted():
    """A real FSDP2 forward and backward over 2 ranks of torch's in-process fake backend (its
    collectives do nothing, FSDP2 does not know): its parameter all-gathers and its gradient
    reduce-scatters, whatever functions the installed torch routes them through, are counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        collectives.install()
        mesh = init_device_mesh("cpu", (2,))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        collectives.reset()
        model(torch.ones(3, 8)).sum().backward()
        ops = {op: calls for (op, _), (calls, _) in collectives.counts().items()}
    finally:
        dist.destroy_process_group()
    gathers = sum(ops.get(op, 0) for op in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"))
    scatters = sum(ops.get(op, 0) for op in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"))
    assert gathers >= 2 and scatters >= 2, ops  # each of the 2 layers' parameters gathered, gradients scattered


@pytest.mark.gpu
def test_coalesced_async_all_reduce_on_nccl(tmp_path):
    """The first GPU run's failure, on the real backend: Megatron DDP's overlapped gradient reduce
    (async all-reduces inside _coalescing_manager) through the installed wrapper on NCCL."""
    from torch.distributed.distributed_c10d import _coalescing_manager, _world

    torch.cuda.set_device(0)
    owner = not dist.is_initialized()  # another gpu test in this process may have left its world up
    if owner:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        collectives.install()
        group = dist.new_group([0], backend="nccl")
        tensors = [torch.full((1024,), float(i), device="cuda") for i in range(3)]
        with _coalescing_manager(group, device=torch.device("cuda"), async_ops=True) as cm:
            for t in tensors:
                dist.all_reduce(t, group=group, async_op=True)
        cm.wait()
        assert not _world.pg_coalesce_state.get(group)
        assert [float(t[0]) for t in tensors] == [0.0, 1.0, 2.0]
        dist.all_reduce(tensors[1], group=group)
        torch.cuda.synchronize()
        assert float(tensors[1][0]) == 1.0
    finally:
        if owner:
            dist.destroy_process_group()


def test_a_host_tensor_on_an_nccl_group_is_refused_by_name(world, monkeypatch):
    """NCCL's own error for a host tensor names neither the collective nor the group: the wrapper
    refuses it first (the backend stubbed as NCCL on this gloo world; a composite backend with
    gloo for the CPU takes host tensors)."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(collectives.CollectiveError, match=r"collective all_reduce on group 'world' .* a host tensor "
                                                          r"\(\(3,\), torch.float64\) on an NCCL group"):
        dist.all_reduce(torch.zeros(3, dtype=torch.float64))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
