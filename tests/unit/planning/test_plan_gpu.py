"""The memory plan against torch.cuda's allocator on one GPU (skipped without a CUDA device,
tests/conftest.py; not yet run by this project: no GPU in its CI so far).

One rank, TP1, a small bf16 Llama: after the build the allocated bytes are the actor's model
states, and the peak of an update adds the activations and logits of one micro-batch; both within
10% of the plan's figures (the plan's per-GPU overhead constant is not allocator memory and is left
out)."""
import pytest

pytestmark = pytest.mark.gpu


def test_allocated_bytes_per_phase_match_the_plan(tmp_path, monkeypatch):
    import torch

    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import default_options, MegatronEngine
    from verl_hpc.engines.batch import get_response_mask, pack_sequences
    from verl_hpc.models import load_arch
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.parallel import init_model_parallel
    from verl_hpc.planning.model_shape import stage_params
    from verl_hpc.engines.logits import device_free_bytes
    from verl_hpc.planning.output_layer import output_chunk
    from verl_hpc.planning.training import (ActivationSetup, Precision, logits_bytes,
                                            model_state_bytes, stage_activation_bytes)
    from verl_hpc.runtime import bootstrap

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="29531").items():
        monkeypatch.setenv(k, v)
    folder = make_tiny_model(tmp_path / "m", layers=4, hidden=1024, heads=8, kv_heads=4,
                             head_dim=128, ffn=2816, vocab_size=500, max_positions=1024)
    bootstrap(backend="auto", num_threads=1, timeout_s=120)
    init_model_parallel(1, 1, seed=1)
    arch = load_arch(folder)
    s, b = 1024, 2
    base = torch.cuda.memory_allocated()
    eng = MegatronEngine(default_options(model_path=str(folder), dtype="bfloat16", micro_batch_size=b,
                                         optim=OptimConfig(lr=1e-5)))
    g = torch.Generator().manual_seed(0)
    batch = pack_sequences([torch.randint(5, 400, (s // 2,), generator=g).tolist()] * b,
                           [torch.randint(5, 400, (s // 2,), generator=g).tolist()] * b)
    batch["response_mask"] = get_response_mask(batch)

    def loss(out, mb, counts):
        return -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens, {}

    eng.train_step(batch, loss)  # Adam states exist after the first step
    states = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    eng.train_step(batch, loss)
    peak = torch.cuda.max_memory_allocated() - base

    prec = Precision.of("bfloat16")
    planned_states = sum(model_state_bytes(stage_params(arch, 1, 1, 0), prec, trainable=True, dp=1,
                                           distributed_optimizer=True).values())
    setup = ActivationSetup(tp=1, sequence_parallel=False, recompute="none", recompute_method="uniform",
                            recompute_num_layers=1, impl="te")
    acts = stage_activation_bytes(arch, arch.num_layers, s, b, prec.act_bytes, setup, True)["saved"]
    # the engine's default (model.logits_chunk_tokens = auto): on a GPU the memory free decides
    chunk = output_chunk(None, 512, s * b, prec.act_bytes, device_free_bytes(torch.device('cuda')))
    planned_peak = planned_states + acts + logits_bytes(arch, s * b, 1, prec.act_bytes, "lm", 512, chunk)
    print(f"states {states:,} vs plan {planned_states:,.0f}; update peak {peak:,} vs plan {planned_peak:,.0f}")
    assert states == pytest.approx(planned_states, rel=0.10)
    assert peak == pytest.approx(planned_peak, rel=0.10)


def test_pinned_host_allocations_round_to_a_power_of_two_as_planned():
    """The planner's hardware.pinned against torch's CachingHostAllocator: the pinned bytes it owns
    after one allocation of an odd size (kept cached after the tensor is freed)."""
    import torch

    from verl_hpc.planning import hardware

    def owned():
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    nbytes = (3 << 20) + 12345  # an odd size, not a cached one
    before = owned()
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    assert owned() - before == hardware.pinned(nbytes) == 4 << 20
    del buf
    assert owned() - before == hardware.pinned(nbytes)  # freed into the cache, still held
