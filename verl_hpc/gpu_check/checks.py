"""The checks of `python -m verl_hpc.gpu_check`, in the order they run (one process, one GPU).

Each check is a function of the shared `Kit` that returns a detail string (PASS), raises (FAIL) or
raises `NotTestable` (with why). A check whose prerequisite did not pass is reported as skipped;
prerequisites are only what a check cannot run without (the runtime, Megatron's parallel state),
never another check's verdict: the checks after train_step train their own engine where train_step
failed, so one failure shows every other. Between checks the runner clears what a failed check can
leave behind (kit.reset_between_checks).
`rehearsal=True` (--cpu-rehearsal) runs the same code on CPU with gloo and float32: it tests the
kit itself on a machine without a GPU; nothing it reports is a GPU result.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List

from verl_hpc.gpu_check import fp16_check, fsdp_checks, workload
from verl_hpc.gpu_check.kit import Check, Kit, NotTestable


# ----------------------------------------------------------------------------- toolchain
def compile_toolchain(kit: Kit) -> str:
    """Before any engine: Megatron's fused SwiGLU (auto-on with a GPU) is a torch.compile kernel,
    and Triton builds a C launcher for it with the system compiler against Python.h."""
    from verl_hpc.gpu_check.preflight import toolchain_problems

    problems = toolchain_problems()
    assert not problems, "torch.compile cannot build kernels here: " + "; ".join(problems)
    import sysconfig

    return f"C compiler found; Python.h in {sysconfig.get_paths()['include']}"


# ----------------------------------------------------------------------------- runtime
def nccl_bootstrap(kit: Kit) -> str:
    """World size 1 through the project's runtime, then every torch.distributed collective the
    project calls (grep verl_hpc for `dist.`), on the backend's device."""
    import torch
    import torch.distributed as dist

    from verl_hpc.runtime.bootstrap import bootstrap
    from verl_hpc.runtime.device import collective_device
    from verl_hpc.runtime.launch_env import LaunchEnv
    from verl_hpc.runtime.local_ranks import free_port

    env = LaunchEnv(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
                    node_rank=0, master_addr="127.0.0.1", master_port=free_port())
    kit.ctx = bootstrap(backend="gloo" if kit.rehearsal else "nccl", timeout_s=300, env=env)
    want = "gloo" if kit.rehearsal else "nccl"
    assert dist.get_backend() == want, f"backend {dist.get_backend()}, expected {want}"
    dev = collective_device()
    t = torch.tensor([1.0, 2.0], device=dev)
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.broadcast(t, src=0)
    parts = [torch.empty_like(t)]
    dist.all_gather(parts, t)
    assert torch.equal(parts[0], t)
    box = [{"k": 1}]
    dist.broadcast_object_list(box, src=0)
    gathered = [None]
    dist.all_gather_object(gathered, ("x", 2))
    got = [None]
    dist.gather_object(("y", 3), got, dst=0)
    out = [None]
    dist.scatter_object_list(out, [("z", 4)], src=0)
    sub = dist.new_group([0])
    dist.all_reduce(t, group=sub)
    dist.barrier()
    assert gathered == [("x", 2)] and got == [("y", 3)] and out == [("z", 4)] and box == [{"k": 1}]
    agreed = kit.ctx.preemption.agreed()  # the trainer's one all-reduce per step
    assert agreed is False
    return f"backend {want} on {kit.ctx.device}; 10 collective kinds + preemption agreement"


def megatron_parallel(kit: Kit) -> str:
    try:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
    except ImportError as e:
        raise NotTestable(f"megatron-core does not import ({e}); the kit's wheels carry it (python -m "
                          "verl_hpc.gpu_check.wheels). The Megatron engine's checks need it, the FSDP ones do not") from None
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from verl_hpc.parallel import init_model_parallel

    mp = init_model_parallel(1, 1, seed=1234, timeout_minutes=5)
    assert (mp.tp, mp.pp, mp.dp) == (1, 1, 1)
    if not kit.rehearsal:
        assert mp.cpu_patches == (), f"CPU help applied on a GPU: {mp.cpu_patches}"
    assert isinstance(get_cuda_rng_tracker(), CudaRNGStatesTracker)
    return "Megatron groups at tp=1 pp=1 (5-minute timeout), Megatron's own RNG tracker"


def cuda_rng_checkpoint(kit: Kit) -> str:
    """The CUDA generator and Megatron's tracker streams survive an HDF5 checkpoint exactly."""
    import torch
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from verl_hpc.checkpoint import (capture_rng_state, read_rank_state, restore_rng_state,
                                     save_checkpoint)

    dev = "cpu" if kit.rehearsal else "cuda"
    tracker = get_cuda_rng_tracker()

    def draw():
        with tracker.fork():
            a = torch.rand(8, device=dev)
        return a, torch.rand(8, device=dev)

    draw()  # the streams are in use before the capture, as in a run
    state = capture_rng_state()
    if not kit.rehearsal:
        assert "torch_cuda" in state, "no CUDA generator state captured"
    assert any(k.startswith("megatron_tracker_") for k in state), "no Megatron tracker state"
    ckpt = save_checkpoint(kit.out / "rng", 1, [], rank_state=state)
    first = draw()
    draw()  # move on, then restore from the file
    restore_rng_state(read_rank_state(ckpt, 0))
    again = draw()
    assert all(torch.equal(x, y) for x, y in zip(first, again)), "streams differ after restore"
    return f"{len(state)} RNG states saved to {ckpt.name} and restored bit-exactly"


# ----------------------------------------------------------------------------- engine
_tiny_model, _hf_log_probs = workload.tiny_model, workload.hf_log_probs
_batch, _loss_fn = workload.batch, workload.loss_fn


def engine_logprob_parity(kit: Kit) -> str:
    """The frozen engine (reference role) in model dtype vs transformers on the same device."""
    import torch

    from verl_hpc.engines.megatron import default_options, MegatronEngine

    path = _tiny_model(kit)
    batch = _batch()
    eng = kit.measure("engine build (frozen)", lambda: MegatronEngine(default_options(
        model_path=path, trainable=False, dtype=kit.dtype, micro_batch_size=2)))
    got = kit.measure("engine forward (log-probs)", lambda: eng.forward(batch, ("log_probs",)))
    device = "cpu" if kit.rehearsal else "cuda"
    ref = _hf_log_probs(path, batch, getattr(torch, kit.dtype), device)
    mask = torch.arange(ref.shape[1])[None] < batch["response_lengths"][:, None]
    diff = (got["log_probs"].float().cpu() - ref).abs()[mask]
    bound = 1e-4 if kit.rehearsal else 0.1  # bf16: two implementations, different kernels
    assert float(diff.max()) < bound, f"max |engine - transformers| = {float(diff.max()):.3g} >= {bound}"
    eng = None  # free it before the next check (a name the lambdas above close over)
    return (f"{kit.dtype}: max |diff| {float(diff.max()):.3g}, mean {float(diff.mean()):.3g} over "
            f"{int(mask.sum())} tokens (bound {bound})")


def _train_engine(kit: Kit):
    """The kit runs one rank: data-parallel size 1, where the engine does not shard the optimizer
    (engines/megatron/wiring.py `shard_optimizer`: nothing to shard over), whatever use_distributed_optimizer says.
    The sharded optimizer runs in the two-GPU check (tp_gt_1, its DP 2 part)."""
    from verl_hpc.engines.megatron import MegatronEngine

    return MegatronEngine(workload.train_options(_tiny_model(kit), kit.dtype, use_distributed_optimizer=True))


def train_step(kit: Kit) -> str:
    """One optimizer step at dp 1: Megatron DDP + its plain mixed-precision (bf16) optimizer (and,
    on GPU, the fused kernels / overlap that auto turns on)."""
    import torch

    kit.engine = eng = kit.measure("engine build (trainable)", lambda: _train_engine(kit))
    assert not eng.shard_optimizer, "dp 1: the engine was expected not to shard the optimizer"
    before = [p.detach().clone() for p in eng._parameters()]
    m = kit.measure("train step", lambda: eng.train_step(_batch(1), _loss_fn))
    assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), m
    moved = sum(not torch.equal(a, b) for a, b in zip(before, eng._parameters()))
    assert moved > 0, "no parameter changed"
    chained = eng.optimizer.chained_optimizers[0]
    inner = type(chained.optimizer)
    return (f"dp 1 (distributed optimizer not used: nothing to shard); loss {m['loss']:.4f}, grad norm "
            f"{m['grad_norm']:.3g}, {moved} tensors updated; {type(chained).__name__} over "
            f"{inner.__module__}.{inner.__name__}; {eng.perf}")


def lora_step(kit: Kit) -> str:
    """LoRA in the model dtype (on GPU: the Transformer Engine spec when TE is installed, whose
    fused LayerNorm-linear layers feed the adapter the normalised input): a fresh adapter and the
    adapters off give the base's log-probs bitwise; one step moves the adapters only; afterwards the
    adapters change the log-probs and switching them off gives the base again, bitwise."""
    import torch

    from verl_hpc.config.schema import LoraConfig
    from verl_hpc.engines.megatron import MegatronEngine

    opts = workload.train_options(_tiny_model(kit), kit.dtype, use_distributed_optimizer=True)
    eng = kit.measure("engine build (LoRA)", lambda: MegatronEngine(
        dataclasses.replace(opts, lora=LoraConfig(rank=8, alpha=16.0))))
    batch = _batch()
    fresh = eng.forward(batch, ("log_probs",))["log_probs"]
    with eng.adapters_off():
        base = eng.forward(batch, ("log_probs",))["log_probs"]
    assert torch.equal(fresh, base), "a fresh adapter (B = 0) changed the output"
    frozen = [p.detach().clone() for p in eng._parameters() if not p.requires_grad]
    m = kit.measure("LoRA train step", lambda: eng.train_step(_batch(1), _loss_fn))
    assert m["nonfinite"] == 0.0 and math.isfinite(m["loss"]), m
    assert all(torch.equal(a, b) for a, b in zip(frozen, (p for p in eng._parameters() if not p.requires_grad))), \
        "a frozen base weight moved"
    after = eng.forward(batch, ("log_probs",))["log_probs"]
    with eng.adapters_off():
        off = eng.forward(batch, ("log_probs",))["log_probs"]
    assert torch.equal(off, base), "adapters off is not the base model after a step"
    moved = float((after.float() - base.float()).abs().max())
    assert moved > 0, "the step did not change the adapters' output"
    n = sum(t.numel() for _, t in eng.export_adapter())
    spec = type(eng.gpt_chunks[0].decoder.layers[0].self_attention.linear_qkv).__name__
    eng = None
    return (f"{kit.dtype}, {spec}: fresh and off = base bitwise; one step moved the output by {moved:.3g}; "
            f"{len(frozen)} base tensors unchanged; adapter export {n} elements")


def _params(eng):
    return [p.detach().clone() for p in eng._parameters()]


def save_resume(kit: Kit) -> str:
    """state() -> HDF5 checkpoint -> a new engine loads it; two more steps on both are bitwise equal
    (covers the fused Adam's per-group step when Megatron picked one)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # flash / mem-efficient backward are not deterministic
        return _save_resume(kit)


def _trained_engine(kit: Kit):
    """train_step's engine, or (where that check failed or was not run) one trained a step here:
    the checks after train_step need an engine that has stepped, not train_step's verdict."""
    if kit.engine is None:
        kit.engine = _train_engine(kit)
        kit.engine.train_step(_batch(1), _loss_fn)
    return kit.engine


def _save_resume(kit: Kit) -> str:
    import torch

    from verl_hpc.checkpoint import load_into, read_metadata, save_checkpoint
    from verl_hpc.engines.megatron.state import optimizer_step_count

    eng = _trained_engine(kit)
    st = kit.measure("state save", lambda: eng.state())
    ckpt = save_checkpoint(kit.out / "engine", eng.steps_applied, st.tensors, metadata={"engine": st.meta})
    for k in (2, 3):
        eng.train_step(_batch(k), _loss_fn)
    want = _params(eng)
    resumed = _train_engine(kit)
    meta = read_metadata(ckpt)["engine"]
    kit.measure("state load", lambda: resumed.load_state(lambda targets: load_into(ckpt, targets), meta))
    assert optimizer_step_count(resumed.optimizer) == optimizer_step_count(eng.optimizer) - 2 == \
        meta["optimizer_step"], "optimizer step count not restored"
    for k in (2, 3):
        resumed.train_step(_batch(k), _loss_fn)
    same = [torch.equal(a, b) for a, b in zip(want, _params(resumed))]
    assert all(same), f"{same.count(False)} of {len(same)} tensors differ after resume"
    resumed = None  # free it before the next check
    return f"{len(st.tensors)} slabs, step {meta['optimizer_step']} -> +2 steps bitwise equal"


def fused_adam_resume(kit: Kit) -> str:
    inner = _trained_engine(kit).optimizer.chained_optimizers[0].optimizer
    name = f"{type(inner).__module__}.{type(inner).__name__}"
    if "fused" not in name.lower():
        raise NotTestable(f"Megatron picked {name} (no Transformer Engine / apex FusedAdam here)")
    groups = [g for g in inner.param_groups if g["params"]]
    assert all("step" in g for g in groups), "fused Adam without a per-group step"
    return f"{name}: per-group step {groups[0]['step']}; resume bitwise (save_resume)"


def memory_plan(kit: Kit) -> str:
    """The planner's prediction for the kit's own job against max_memory_allocated while that job's
    actor is built and takes two steps (memplan.run)."""
    from verl_hpc.gpu_check import memplan

    result = memplan.run(kit.out / "plan_llama", rehearsal=kit.rehearsal)
    peaks = "; ".join(f"{c} {b / 2**20:.0f} MiB" for c, b in kit.peaks.items())
    if result.measured is None:
        raise NotTestable("CPU rehearsal: no GPU memory to measure (the job was planned and trained: "
                          f"{result.describe()})")
    assert result.within, f"{result.describe()}; the earlier checks' peaks: {peaks}"
    return f"{result.describe()}; earlier checks' peaks: {peaks}"


# ----------------------------------------------------------------------------- what one GPU cannot show
def te_fp8(kit: Kit) -> str:
    from verl_hpc.engines.megatron import default_options, MegatronEngine
    from verl_hpc.models.gpt import transformer_engine_available

    if kit.rehearsal or not transformer_engine_available():
        raise NotTestable("needs Transformer Engine (the GPU image; not in the carried wheels)")
    import torch

    from verl_hpc.runtime.device import compute_capability

    if compute_capability() < (8, 9):
        raise NotTestable(f"FP8 needs compute capability >= 8.9; this GPU has {compute_capability()}")
    eng = MegatronEngine(default_options(model_path=_tiny_model(kit), trainable=False,
                                         dtype="bfloat16", fp8=True, micro_batch_size=2))
    out = eng.forward(_batch(), ("log_probs",))
    assert torch.isfinite(out["log_probs"]).all()
    return "TE layer spec, fp8 hybrid/delayed forward finite"


def vllm_gpu(kit: Kit) -> str:
    """vLLM in this process beside the trained engine, as a job runs it: bf16, sleep mode (the
    config's default level: 2 drops the weights), wake, the actor's weights loaded from
    `export_hf_weights`, greedy generation; vLLM's log-probs of what it generated against the
    engine's log-probs of the same tokens."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        raise NotTestable("vLLM is not installed (an offline node gets it from the vLLM kit: make gpu-vllm-kit, "
                          "docs/gpu.md; with a network, scripts/install_gpu.sh)")
    from verl_hpc.config import load_config
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.sampling import default_spec

    prompts = [list(range(10, 10 + n)) for n in (3, 11, 24)]
    new = 16
    rollout = kit.measure("vllm build", lambda: VLLMRollout(
        _tiny_model(kit), sleep_between_phases=True, sleep_level=load_config(None).rollout.sleep_level,
        **default_engine_args("vllm", dtype=kit.dtype, max_prompt_length=32, max_response_length=new,
                              gpu_memory_utilization=0.2)))
    try:
        greedy = default_spec(temperature=0, max_tokens=new)
        first = rollout.generate(prompts, greedy)
        rollout.sleep()
        rollout.wake()
        kit.measure("vllm load_weights", lambda: rollout.load_weights(_trained_engine(kit).export_hf_weights()))
        got = rollout.generate(prompts, greedy)
    finally:
        rollout.close()
    assert all(1 <= len(r) <= new for r in first.response_ids + got.response_ids)
    # the engine's log-probs of the same rows (the trained engine's weights are what vLLM loaded)
    rows = [p + r for p, r in zip(prompts, got.response_ids)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    batch = {"input_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in prompts]),
             "response_lengths": torch.tensor([len(r) for r in got.response_ids])}
    ours = kit.engine.forward(batch, ("log_probs",))["log_probs"].float().cpu()
    diffs = [abs(float(ours[i, j]) - lp) for i, lps in enumerate(got.logprobs) for j, lp in enumerate(lps)]
    bound = 1e-3 if kit.rehearsal else 0.25  # bf16: two implementations' kernels
    assert max(diffs) < bound, f"vLLM vs engine log-probs: max |diff| {max(diffs):.3g} >= {bound}"
    return (f"{kit.dtype}, sleep level {rollout.sleep_level} -> wake -> load_weights -> generate; vLLM vs engine "
            f"log-probs max |diff| {max(diffs):.3g}, mean {sum(diffs) / len(diffs):.3g} over "
            f"{len(diffs)} tokens (bound {bound})")


def tp_gt_1(kit: Kit) -> str:
    """Two ranks on two GPUs (multi_gpu.py): TP 2 log-probs vs transformers and a TP 2 step, the
    sliced weight sync of that engine (NCCL all_to_all, delta checksums on the device), then a DP 2
    step with the distributed optimizer, parameters equal on both ranks."""
    import torch

    from verl_hpc.gpu_check.multi_gpu import WORLD, run_two_ranks
    from verl_hpc.runtime.device import visible_device_count

    if not kit.rehearsal and visible_device_count() < WORLD:
        raise NotTestable(f"needs >= {WORLD} GPUs on this node; {visible_device_count()} visible")
    path = _tiny_model(kit)
    res = run_two_ranks(kit.out, path, kit.rehearsal, kit.dtype)
    batch = _batch()
    ref = _hf_log_probs(path, batch, getattr(torch, kit.dtype), "cpu" if kit.rehearsal else "cuda")
    got = torch.tensor(res["tp2_log_probs"])
    mask = torch.arange(ref.shape[1])[None] < batch["response_lengths"][:, None]
    diff = (got - ref).abs()[mask]
    bound = 1e-4 if kit.rehearsal else 0.1
    assert float(diff.max()) < bound, f"TP 2 vs transformers: max |diff| {float(diff.max()):.3g} >= {bound}"
    sync = res["sliced_sync"]
    for layout, s in sync.items():
        assert not s["mismatches"], f"sliced weight sync into {layout}: slices differ from the export: {s['mismatches']}"
        assert s["delta_bytes"] == 0, f"sliced weight sync into {layout}: a delta of nothing sent {s['delta_bytes']} bytes"
    assert sync["inference_tp2"]["bytes"] < 0.6 * sync["inference_tp1"]["bytes"], sync
    return (f"{res['backend']}: TP 2 log-probs max |diff| {float(diff.max()):.3g} (bound {bound}), TP 2 step "
            f"loss {res['tp2_step']['loss']:.4f}; sliced weight sync bitwise into inference TP 2 / TP 1 "
            f"({sync['inference_tp2']['bytes'] / 1e6:.2f} / {sync['inference_tp1']['bytes'] / 1e6:.2f} MB a rank), "
            f"a delta of nothing 0 bytes; DP 2 {res['dp2_step']['optimizer']} step, ranks equal")


def cp_gt_1(kit: Kit) -> str:
    """Context parallel 2 vs 1 on two GPUs (cp_check.py): log-probs and entropy, one update's
    loss and the log-probs after it. Megatron's CP attention is Transformer Engine's only."""
    from verl_hpc.gpu_check import cp_check
    from verl_hpc.gpu_check.multi_gpu import run_two_ranks
    from verl_hpc.models.gpt import transformer_engine_available
    from verl_hpc.runtime.device import visible_device_count

    if kit.rehearsal or not transformer_engine_available():
        raise NotTestable("needs Transformer Engine (Megatron's context-parallel attention); the CPU "
                          "rehearsal of its comparison is a unit test")
    if visible_device_count() < cp_check.WORLD:
        raise NotTestable(f"needs >= {cp_check.WORLD} GPUs on this node; {visible_device_count()} visible")
    res = run_two_ranks(kit.out, _tiny_model(kit), kit.rehearsal, kit.dtype, module="verl_hpc.gpu_check.cp_check",
                        name="context_parallel")
    return f"{res['backend']}: " + cp_check.compare(res["cp1"], res["cp2"], res["cp1"]["response_lengths"], bound=0.1)


def multinode_nccl(kit: Kit) -> str:
    raise NotTestable("needs several nodes (python -m verl_hpc.submit configs/smoke.yaml on Slurm)")


ENGINE = ("megatron_parallel", "compile_toolchain")
CHECKS: List[Check] = [
    Check("compile_toolchain", "a C compiler and Python.h for torch.compile (fused SwiGLU)",
          compile_toolchain, machine="any"),
    Check("nccl_bootstrap", "runtime bootstrap at world size 1 on NCCL + every collective the "
          "project uses", nccl_bootstrap),
    Check("fsdp_bf16_logprobs", "FSDP2 engine in bf16 mixed precision (fp32 master weights) vs "
          "transformers on the GPU (log-probs); no megatron import", fsdp_checks.fsdp_logprobs, ("nccl_bootstrap",)),
    Check("fsdp_step_export", "FSDP2 engine: one update, export_hf_weights -> HF folder -> transformers "
          "log-probs = the engine's", fsdp_checks.fsdp_step_export, ("fsdp_bf16_logprobs",)),
    Check("fsdp_memory_plan", "the memory plan of the kit's job on the FSDP engine vs max_memory_allocated",
          fsdp_checks.fsdp_memory_plan, ("fsdp_step_export",)),
    Check("megatron_parallel", "Megatron model parallel on NCCL, its own CUDA RNG tracker",
          megatron_parallel, ("nccl_bootstrap",)),
    Check("cuda_rng_checkpoint", "CUDA + Megatron tracker RNG states through an HDF5 checkpoint",
          cuda_rng_checkpoint, ("megatron_parallel",)),
    Check("engine_bf16_logprobs", "Megatron engine in bf16 vs transformers on the GPU (log-probs)",
          engine_logprob_parity, ENGINE),
    Check("train_step", "a train step at dp 1: DDP + Megatron's bf16 optimizer (dp 1 does not shard)",
          train_step, ENGINE),
    Check("save_resume", "engine state -> HDF5 -> new engine: next steps bitwise equal", save_resume,
          ENGINE),
    Check("fused_adam_resume", "Megatron's fused Adam keeps its step per group; resumed exactly",
          fused_adam_resume, ENGINE, "1 GPU + TE or apex (a fused Adam)"),
    Check("lora_step", "LoRA: fresh/off = base bitwise, a step moves the adapters only (TE spec on GPU)",
          lora_step, ENGINE),
    Check("memory_plan", "the memory plan's update_actor peak vs max_memory_allocated of the kit's job",
          memory_plan, ENGINE),
    Check("te_fp8", "Transformer Engine spec with FP8", te_fp8, ENGINE,
          "1 GPU (sm >= 8.9) + Transformer Engine"),
    Check("vllm_gpu", "vLLM beside the engine: bf16, sleep level 2, wake, load_weights, log-probs",
          vllm_gpu, ENGINE, "1 GPU + vLLM (the vLLM kit: make gpu-vllm-kit)"),
    Check("tp_gt_1", "TP 2 (log-probs, a step, the sliced weight sync) and DP 2 with the distributed optimizer, 2 ranks",
          tp_gt_1, ENGINE, ">= 2 GPUs on this node"),
    Check("cp_gt_1", "context parallel 2 vs 1 (Megatron CP, TE attention): log-probs, entropy, one update, 2 ranks",
          cp_gt_1, ENGINE, ">= 2 GPUs on this node + Transformer Engine"),
    # last of the one-GPU work: two engines and two rollout engines, after every other check
    Check("fp16_mismatch", "rollout/training mismatch bf16 vs fp16: engine + rollout (vLLM, else HF) in each "
          "dtype, the weight sync, sampled tokens' log-prob gap and KL; an fp16 update with loss scaling",
          fp16_check.fp16_mismatch, ENGINE),
    Check("multinode_nccl", "NCCL across nodes (InfiniBand)", multinode_nccl, machine=">= 2 nodes"),
]
