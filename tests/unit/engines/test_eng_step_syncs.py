"""Host synchronisations on a train step's path (issue 85, suspects 4 and 6), counted on CPU by
verl_hpc/runtime/host_syncs.py (spies on item / float / tolist / blocking copies / synchronize,
each attributed to the project line that made it), and the optimizer phase's kernels by a
dispatch-mode recorder:

- both engines read the host once between the backward and the optimizer's kernels: the metric
  sums and the gradient norm in one transfer (they read the metrics, then the norm, and FSDP
  pickled the metric names even alone);
- the norm is one foreach call and the clip one foreach multiply (FSDP: one DTensor op per
  parameter; Megatron without TE or apex: one host read per gradient for the norm, a copy per
  gradient for the clip); both equal the per-parameter references;
- per micro-batch: Megatron's token count is filled on the device, not copied there; FSDP's
  inputs go to the device without a wait; an offloader with nothing offloaded does not
  synchronise.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from update_reference import policy_batch
from verl_hpc.config.schema import OptimConfig
from verl_hpc.runtime.host_syncs import HostSyncs

OPTIM = OptimConfig(lr=0.1, clip_grad=1e-3, weight_decay=0.01)  # a clip that always scales


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sync_models") / "llama", family="llama", layers=2)


def _engine(kind, folder, **changes):
    from verl_hpc.engines.options import default_options

    o = default_options(str(folder), engine=kind, optim=OPTIM, total_steps=4, micro_batch_size=2, **changes)
    if kind == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return FsdpEngine(o)
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    return MegatronEngine(o)


def foreach_refusals(eng, kind) -> list:
    """After each backward of `eng` (an FSDP engine), why its gradients would take the per-parameter
    norm (engines/fsdp/optim.py per_parameter_reason; None: the foreach one): a failure names the
    cause (the flag, two layouts, a partial placement) rather than only the ops it ran instead."""
    seen = []
    if kind != "fsdp":
        return seen
    import verl_hpc.engines.fsdp.optim as optim_lib

    backward = eng.forward_backward

    def then_look(*args, **kwargs):
        records = backward(*args, **kwargs)
        seen.append(optim_lib.per_parameter_reason([p.grad for p in eng.model.parameters() if p.grad is not None]))
        return records

    eng.forward_backward = then_look
    return seen


def nll(out, mb, counts):
    lp = out["log_probs"] * mb["response_mask"]
    return -lp.sum() / counts.tokens, {"mean_logp": lp.sum() / counts.tokens}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_the_step_reads_the_host_once_before_the_optimizer(one_rank_world, llama, kind):
    """Everything the step does after its backward (the metric sums, the norm, the clip, Adam) reads
    the host once. On a CPU the recorder counts host tensors too, so the forward and backward's own
    reads of the batch (host data on a GPU) are left out: the count starts when the backward ends."""
    eng = _engine(kind, llama)
    batch = policy_batch(6)
    eng.train_step(batch, nll)  # the optimizer's state exists from here on
    refusals = foreach_refusals(eng, kind)
    backward = eng.forward_backward
    with HostSyncs() as syncs:
        def then_count(*args, **kwargs):
            records = backward(*args, **kwargs)
            syncs.events.clear()
            return records

        eng.forward_backward = then_count
        metrics = eng.train_step(batch, nll)
        after = list(syncs.events)
    reads = after
    assert not any(refusals), refusals
    assert [kind for kind, _ in reads] == ["tolist"], reads
    assert "optim.py" in reads[0][1]
    assert metrics["num_microbatches"] > 1 and metrics["grad_norm"] > 0 and "mean_logp" in metrics


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_norm_and_clip_are_one_foreach_call_each_and_equal_the_references(one_rank_world, llama, kind):
    """The step's gradient norm and clip: one _foreach_norm and one _foreach_mul_, no per-parameter
    norm or scale; the norm equals the per-parameter reference and the clipped step the weights a
    per-parameter clip gives (the same step taken by a second engine with the old forms)."""
    batch = policy_batch(6)
    eng = _engine(kind, llama)
    refusals = foreach_refusals(eng, kind)
    with OpCounter() as ops:
        metrics = eng.train_step(batch, nll)
    assert not any(refusals), refusals
    assert ops.ops.get("_foreach_norm") == 1 and ops.ops.get("_foreach_mul_") == 1, ops.ops
    assert ops.ops.get("linalg_vector_norm", 0) + ops.ops.get("norm", 0) <= 1, ops.ops  # the norm of the norms
    ref = _engine(kind, llama)
    ref_norm = _reference_step(kind, ref, batch)
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-6)
    got = dict(eng.export_hf_weights())
    for name, t in ref.export_hf_weights():
        torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-7, msg=name)


def _reference_step(kind, eng, batch) -> float:
    """One step with the per-parameter norm and clip (torch's get_total_norm without foreach and
    a mul_ per DTensor gradient; Megatron's own get_grad_norm and clip_grad_by_total_norm_fp32)."""
    if kind == "fsdp":
        import verl_hpc.engines.fsdp.optim as optim_lib

        eng.forward_backward(batch, nll)
        grads = [p.grad for p in eng.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=False).full_tensor().item()
        with torch.no_grad():
            for g in grads:
                g.mul_(OPTIM.clip_grad / (norm + 1e-6))
        eng.optimizer.step()
        assert optim_lib.FOREACH
        return norm
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    eng.forward_backward(batch, nll)
    finalize_model_grads(eng.chunks, num_tokens=None)
    eng.optimizer.prepare_grads()
    norm = float(eng.optimizer.get_grad_norm())
    for opt in eng.optimizer.chained_optimizers:
        clip_grad_by_total_norm_fp32(opt.get_parameters(), max_norm=OPTIM.clip_grad, total_norm=norm)
    with torch.no_grad():
        eng.optimizer.step_with_ready_grads()
    return norm


def test_fsdp_loop_forms_stay_for_the_benchmark(one_rank_world, llama, monkeypatch):
    """optim.FOREACH = False: the per-parameter norm and clip (the benchmark's fsdp_loopclip column)."""
    import verl_hpc.engines.fsdp.optim as optim_lib

    monkeypatch.setattr(optim_lib, "FOREACH", False)
    eng = _engine("fsdp", llama)
    refusals = foreach_refusals(eng, "fsdp")
    with OpCounter() as ops:
        eng.train_step(policy_batch(6), nll)
    assert "_foreach_norm" not in ops.ops and ops.ops.get("linalg_vector_norm", 0) > 5
    assert refusals and set(refusals) == {"optim.FOREACH is off"}, refusals


def test_which_gradients_take_the_foreach_norm(one_rank_world):
    """One layout over equal meshes (two mesh objects, the same ranks) takes the foreach norm; a
    plain tensor beside a DTensor, or a partial placement, the per-parameter one; both give the norm."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from verl_hpc.engines.fsdp.optim import grad_sq_sum, per_parameter_reason

    a, b = DeviceMesh("cpu", [0], mesh_dim_names=("shard",)), DeviceMesh("cpu", [0], mesh_dim_names=("shard",))
    assert a is not b and a == b
    x, y = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    grads = [DTensor.from_local(x, a, [Shard(0)]), DTensor.from_local(y, b, [Shard(0)])]
    assert per_parameter_reason(grads) is None
    want = float((x ** 2).sum() + (y ** 2).sum())
    assert float(grad_sq_sum(grads)) == pytest.approx(want)
    assert "two layouts" in per_parameter_reason([grads[0], y])
    assert float(grad_sq_sum([grads[0], y])) == pytest.approx(want)
    partial = [DTensor.from_local(x, a, [Partial()])]
    assert "partial" in per_parameter_reason(partial)
    assert float(grad_sq_sum(partial)) == pytest.approx(float((x ** 2).sum()))


def test_megatron_token_count_is_filled_on_the_device(one_rank_world, llama):
    eng = _engine("megatron", llama)
    with HostSyncs() as syncs:
        eng.train_step(policy_batch(6), nll)
    assert not [e for e in syncs.events if e[0] == "tensor_on_device" and "schedule.py" in e[1]], syncs.sites()


def test_fsdp_micro_batches_reach_the_device_without_a_wait(one_rank_world, llama):
    """Every copy of a micro-batch to the device is non-blocking (a blocking one synchronises the
    stream: the host would wait for the step so far before queuing the next micro-batch)."""
    from verl_hpc.engines.fsdp.microbatch import MicroBatch

    batch = policy_batch(6)
    with HostSyncs() as syncs:
        MicroBatch(batch, [0, 1, 2], torch.device("cpu"))
    # the micro-batch's own copies to the device (select_rows' index moves stay on the host: the
    # batch is host data, which a CPU's recorder cannot tell from a device's)
    copies = [e for e in syncs.at("microbatch.py") if e[0] in ("blocking_copy", "tensor_on_device")]
    assert not copies, syncs.sites()


def test_an_offloader_with_nothing_offloaded_does_not_synchronise():
    from verl_hpc.engines.offload import Offloader

    class Eng:
        weights = torch.ones(4)

        def offload_tensors(self):
            return {"params": [self.weights], "grads": [], "optimizer": []}

    off = Offloader(Eng())  # nothing enabled: every step of a resident role
    off.pin = True  # as on a GPU
    with HostSyncs() as syncs:
        with off.resident("train"):
            pass
    assert syncs.counts()["synchronize"] == 0
    on = Offloader(Eng(), params=True)
    on.pin = False  # no pinned memory on the CPU: the copy is plain
    on.offload()
    on.pin = True
    with HostSyncs() as syncs:
        on.onload()
    assert syncs.counts()["synchronize"] == 1  # something came back: wait for the copies


def test_the_recorder_counts_each_kind_where_it_happens():
    x = torch.ones(3)
    with HostSyncs() as syncs:
        float(x.sum())
        x.tolist()
        x.to("cpu")
        x.to("cpu", non_blocking=True)
        torch.tensor(3, device="cpu")
        torch.tensor([1.0])
        x.to(torch.float64)
    assert syncs.counts() == {"item": 1, "tolist": 1, "synchronize": 0, "blocking_copy": 1, "tensor_on_device": 1}
    assert all("test_eng_step_syncs.py" in site for site in syncs.sites())
