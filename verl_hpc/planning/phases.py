"""The memory plan of a job: bytes per rank for each phase of the RL step x each component.

    plan = plan_job(cfg)                  # cfg: a loaded JobConfig
    plan.peak, plan.peak_phase, plan.limit, plan.fits(margin=0.0)
    plan.table  -> {phase: {component: bytes}};  plan.host -> {phase: bytes per node}

Phases, in the order the trainer runs them (verl_hpc/trainer/programs/rl.py), with the lazy weight sync
the trainer follows (as verl does: the rollout's weights are marked stale after every actor update
and brought up to date right before they are next needed):
- build (the Megatron roles built whole, then offloaded), startup (vLLM starts last and needs
  gpu_memory_utilization x total free);
- weight_sync, at the start of every step's rollout phase: `wake(tags=("weights",))` maps vLLM's
  weights but not its KV cache; the actor stays resident until vLLM has loaded the last bucket and
  is offloaded after it; only then is the KV cache mapped (the rollout row);
- rollout: vLLM awake (weights, KV cache, CUDA graphs) generates; the Megatron roles idle;
- then vLLM sleeps (rollout.sleep_between_phases: ~0 device bytes, see rollout.py) for old
  log-probs, reference log-probs, (PRIME) the implicit PRM's forward and update, critic values,
  the critic update and the actor update;
- checkpoint, after the step's hooks: vLLM asleep (a save puts it back to sleep if validation woke
  it); each saved role made resident one at a time with what its state needs: weights and
  optimizer states, no gradients;
- rollback (only with trainer.rollback.enable): the reload, with the same residency;
A role that is not running in a phase keeps only what it does not offload
(actor/critic/ref/prm.*_offload). Per-GPU constants: the CUDA context and NCCL's communicators
(comms.py); host figures: host.py. The peak is the maximum over phases; it is computed for the
first and the last pipeline stage (embedding vs. output layer and logits) and the heavier one is
reported.

Split placement (placement.mode = split) plans each group of ranks on its own (planning/split.py):
the training ranks get the rows above without vLLM and without the startup and rollout phases; the
rollout ranks get vLLM's whole budget, awake, in startup, weight_sync (generation goes on while
the buckets load) and rollout, and no Megatron role.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Union

from verl_hpc.config.errors import raise_if_any
from verl_hpc.models.config_mapping import ModelArch, padded_vocab_size
from verl_hpc.planning import hardware
from verl_hpc.planning.comms import describe, job_communicators, nccl_bytes
from verl_hpc.planning.host import checkpoint_host, reload_host
from verl_hpc.planning.memory_plan import MemoryPlan
from verl_hpc.planning.model_shape import job_arch, lora_layer_params, model_arch, total_params
from verl_hpc.planning.roles import RoleState, fsdp_notes, plan_roles  # noqa: F401 (RoleState: re-exported)
from verl_hpc.planning.rollout import adapter_slot_rank, kv_capacity, rollout_bytes, sleep_level, sleeping
from verl_hpc.planning.split import SplitPlan, ranks_on_nodes
from verl_hpc.planning.training import ActivationSetup, Precision, cp_tokens

PHASES = ("build", "startup", "weight_sync", "rollout", "reward_score", "old_logprob", "ref_logprob", "teacher_logprob",
          "prm_logprob", "update_prm",
          "values", "update_critic", "update_actor", "checkpoint", "rollback")
COMPONENTS = ("actor", "critic", "ref", "prm", "teacher", "reward", "activations", "logits", "gathered", "vllm", "resharding",
              "nccl", "overhead")
ROLLOUT_PHASES = ("startup", "weight_sync", "rollout")  # a split job's rollout ranks: vLLM only
# a split job's training ranks: no vLLM to start or to generate with
TRAINING_PHASES = tuple(p for p in PHASES if p not in ("startup", "rollout"))


def microbatch_shape(role_cfg, cfg) -> tuple:
    """(s, b, micro-batches per optimizer step per DP rank) in the worst case (full-length rows)."""
    max_seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    s = max_seq  # a row longer than the token budget still forms a micro-batch of its own
    if role_cfg.max_tokens_per_microbatch > 0:
        b = max(1, role_cfg.max_tokens_per_microbatch // s)
    else:
        b = role_cfg.micro_batch_size
    rows = max(1, role_cfg.ppo_mini_batch_size * cfg.rollout.n // max(1, cfg.dp))
    return s, b, -(-rows // b)


def _arch_for(path: str, field: str, allow_known: bool) -> ModelArch:
    return model_arch(path, allow_known=allow_known, field=field)


def gpu_total_bytes(cfg, gpu_memory_gb: Optional[float]) -> float:
    if cfg.slurm.gpus_per_node <= 0:
        return 0.0
    if gpu_memory_gb:
        return gpu_memory_gb * hardware.GB
    g = hardware.gpu_type(cfg.slurm.gpu_type)
    return float(g.memory_bytes) if g else 0.0


def plan_job(cfg, *, gpu_memory_gb: Optional[float] = None, node_memory_gb: Optional[float] = None,
             allow_known: bool = True, stage: Optional[int] = None,
             layer_impl: Optional[str] = None) -> Union[MemoryPlan, SplitPlan]:
    """The plan of the heavier of the first and last pipeline stage (or of `stage`); with
    placement.mode = split, a SplitPlan of the rollout group and the training group.

    layer_impl: the layer spec the engine will build ("te" | "local"); default: TE layers on a GPU
    job, the local spec on a CPU job. The planner runs where the job is submitted, which need not
    have Transformer Engine; a caller on the machine itself (the GPU kit) passes what it has."""
    raise_if_any(hardware.memory_figure_problems(gpu_memory_gb, node_memory_gb))
    job_arch(cfg, allow_known)  # a layout `submit` refuses gets no plan either
    args = (gpu_memory_gb, node_memory_gb, allow_known, layer_impl)
    if not cfg.placement.split:
        return _plan_group(cfg, "colocated", stage, *args)
    nodes = ranks_on_nodes(cfg.rollout_world_size, cfg.world_size, cfg.slurm.tasks_per_node, cfg.placement.hetjob)
    return SplitPlan(rollout=_plan_group(cfg, "rollout", 0, *args),  # vLLM has no pipeline stages
                     training=_plan_group(cfg, "training", stage, *args), nodes=nodes)


def _plan_group(cfg, group, stage, *args) -> MemoryPlan:
    pp = cfg.parallel.pp
    stages = [stage] if stage is not None else sorted({0, pp - 1})
    plans = [_plan_stage(cfg, s, *args, group=group) for s in stages]
    return max(plans, key=lambda p: p.checked_peak())


def _group_ranks(cfg, group: str) -> int:
    return {"rollout": cfg.rollout_world_size, "training": cfg.train_world_size}.get(group, cfg.world_size)


def _plan_stage(cfg, stage, gpu_memory_gb, node_memory_gb, allow_known, layer_impl=None,
                group: str = "colocated") -> MemoryPlan:
    par, gpu = cfg.parallel, cfg.slurm.gpus_per_node > 0
    tp = par.tp
    prec = Precision.of(cfg.model.dtype)
    arch = job_arch(cfg, allow_known)  # the actor's shape (an FSDP role's read leniently)
    gpu_total = gpu_total_bytes(cfg, gpu_memory_gb)
    notes: List[str] = []
    sp = par.sequence_parallel and tp > 1
    setup = ActivationSetup(tp=tp, sequence_parallel=sp, recompute=par.recompute_granularity,
                            recompute_method=par.recompute_method,
                            recompute_num_layers=par.recompute_num_layers,
                            impl=layer_impl or ("te" if gpu else "local"))  # GPU: TE layers; CPU: local
    lora = cfg.lora
    planned = plan_roles(cfg, arch, stage, prec, setup, allow_known, gpu, microbatch_shape)
    roles, tensors = dict(planned.states), dict(planned.tensors)
    if lora.enabled:
        fsdp_actor = planned.fsdp.get("actor")
        adapter = (planned.actor_layers * lora_layer_params(arch, lora.rank, lora.target_modules, tp)
                   if fsdp_actor is None else fsdp_actor.adapter_layer * arch.num_layers / fsdp_actor.shard)
        notes.append(f"LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: {adapter / 1e6:.2f} M "
                     f"trainable parameters per rank ({adapter * 4 / 2**20:.1f} MiB fp32) on a frozen base"
                     + ("; the reference is the actor's base (no memory)" if cfg.ref.enable else ""))
    notes += fsdp_notes(cfg, planned)
    if cfg.model.dtype == "float16":
        notes.append("model.dtype float16: the bytes of bf16 (2-byte weights and activations; fp32 master weights, "
                     "grads and Adam states; the loss scaler is one number)"
                     + ("; vLLM and the weight sync in fp16" if gpu else "; the rollout in fp32 on a CPU"))
    if par.cp > 1:
        s = cfg.data.max_prompt_length + cfg.data.max_response_length
        notes.append(f"context parallel {par.cp}: each rank holds {cp_tokens(s, par.cp)} of a {s}-token row "
                     f"(2 x {par.cp} load-balanced chunks), so activations and logits are those of 1/{par.cp} "
                     "of the sequence; the ring attention's in-flight key/value chunks are not counted")
    if group == "rollout":  # the rollout ranks of a split job build no training role
        roles, tensors = {}, {}

    def activations(role_cfg, head, name) -> Dict[str, float]:
        return planned.working(name, role_cfg, head, train=True)

    def forward_working(role_cfg, head, name) -> Dict[str, float]:
        return planned.working(name, role_cfg, head, train=False)

    vl = rollout_bytes(arch, cfg, gpu_total=gpu_total if gpu else 0.0, param_bytes=prec.param_bytes)
    # split: vLLM has its ranks to itself and never sleeps; the training ranks hold none
    asleep = sleeping(cfg) and group == "colocated"
    vllm_idle = {"colocated": vl.asleep_device if asleep else vl.budget, "training": 0.0}.get(group, vl.budget)
    vllm_sync = {"colocated": vl.weights_only, "training": 0.0}.get(group, vl.budget)
    # a bucket never holds more than the whole model
    bucket = min(cfg.resharding.bucket_mb * 2 ** 20, total_params(arch) * prec.param_bytes)
    # a sync holds the bucket, the tensor being gathered (its TP parts + the concatenation: at most
    # the largest weight, the embedding) and vLLM's copy-in: bounded by 2 buckets + the embedding
    largest = padded_vocab_size(arch.vocab_size, tp) * arch.hidden_size * prec.param_bytes
    if planned.engines["actor"] == "fsdp":  # the FSDP engine gathers each full fp32 parameter
        largest = arch.vocab_size * arch.hidden_size * 4.0
    # the sliced sync (colocated) holds a bucket's send and receive buffers while the previous
    # bucket's slices load: one bucket more; split placement publishes over the full path
    sliced = cfg.resharding.mode != "full" and group == "colocated"
    resharding = (3 if sliced else 2) * bucket + largest
    if group == "training" and cfg.resharding.mode != "full":
        # split, sliced: the first training rank cuts each bucket for every rollout rank, on the
        # wire device (counted on every training rank: the plan is per layout, not per rank)
        resharding += bucket * max(cfg.placement.rollout_ranks, 1) / cfg.rollout.tp
    # resharding.delta keeps, on the device, what this rank last sent and its own rollout slices
    # (each about its share of the model in the rollout dtype): in every phase, not just the sync
    delta_copies = (2.0 * total_params(arch) * prec.param_bytes / cfg.rollout.tp
                    if cfg.resharding.delta and sliced else 0.0)
    if adapter_slot_rank(cfg):  # LoRA's adapter sync: the whole adapter, fp32, held twice (export + vLLM's)
        resharding = 2.0 * arch.num_layers * lora_layer_params(arch, lora.rank, lora.target_modules, 1) * 4
    comms = job_communicators(cfg, arch.tie_word_embeddings, group, moe=arch.moe is not None,
                              engines=planned.trained_engines())
    nccl = nccl_bytes(comms)
    overhead = float(hardware.CUDA_CONTEXT_BYTES) if gpu else 0.0
    judge_awake, judge_idle = judge_bytes(cfg, gpu, gpu_total, allow_known) if group != "rollout" else (0.0, 0.0)
    if judge_awake:
        notes.append(judge_note(cfg, gpu, judge_awake))

    def row(active: Dict[str, str], extra: Dict[str, float], vllm: float) -> Dict[str, float]:
        r = {c: 0.0 for c in COMPONENTS}
        # the logits term is a function of what the rest of the row leaves free on the device
        # (planning/output_layer.py: the engines measure the same at the output layer)
        logits = extra.get("logits")
        extra = dict(extra, logits=0.0) if callable(logits) else extra
        for name, st in roles.items():
            r[name] = st.resident(active.get(name, "idle"))
        if judge_awake:  # the generative judge: awake while it scores, asleep (or on the host) else
            r["reward"] += judge_awake if active.get("reward") == "forward" else judge_idle
        r.update(extra)
        r["resharding"] += delta_copies
        r["vllm"] = vllm
        r["nccl"] = nccl
        if callable(logits):
            rest = sum(v for k, v in r.items() if k not in ("overhead", "nccl"))
            free = gpu_total - overhead - nccl - (1 + hardware.FRAGMENTATION) * rest if gpu and gpu_total > 0 else None
            r["logits"] = logits(free)
        tensors = sum(v for k, v in r.items() if k not in ("overhead", "nccl"))
        r["overhead"] = overhead + hardware.FRAGMENTATION * tensors if gpu else 0.0
        return r

    # what a checkpoint holds: the trained roles (a frozen PRM is rebuilt from its folder)
    saved = [n for n in ("actor", "critic", "prm") if n in roles and (n != "prm" or cfg.prm.update != "none")]

    def one_role_at_a_time(extra: Dict[str, float]) -> Dict[str, float]:
        # a role that offloads is made resident (weights + optimizer, no gradients) on its own;
        # the heavier of the saved roles is the row
        return max((row({n: "state"}, extra, vllm_idle) for n in saved), key=lambda r: sum(r.values()))

    if group == "rollout":
        table = _rollout_rows(row, vl.budget, resharding)
    else:
        table = _training_rows(cfg, roles, row, one_role_at_a_time, forward_working, activations,
                               vl.budget, vllm_sync, vllm_idle, resharding)
        if group == "training":
            table = {phase: r for phase, r in table.items() if phase in TRAINING_PHASES}
    blocking: List[str] = []
    if gpu and gpu_total > 0 and group != "training" and cfg.trainer.job == "rl" and cfg.rollout.engine != "hf":
        blocking, kv_notes = kv_capacity(arch, cfg, vl.kv_cache, prec.param_bytes)
        notes += kv_notes
    if comms:
        notes.append(describe(comms))

    # ----- host memory per node: the most ranks of this group one node holds
    per_node = min(_group_ranks(cfg, group), cfg.slurm.tasks_per_node)
    process = hardware.HOST_PROCESS_BYTES_GPU if gpu else hardware.HOST_PROCESS_BYTES_CPU
    offloaded = sum(t.offloaded_pinned() for t in tensors.values()) if gpu else 0.0
    ckpt = checkpoint_host([tensors[n] for n in saved], cfg.checkpoint.async_save, gpu)
    phase_host = {"checkpoint": ckpt["transient"],
                  "rollback": reload_host([tensors[n] for n in saved])}
    asleep_host = vl.asleep_host if asleep else 0.0
    host = {}
    for phase, r in table.items():
        device_on_host = 0.0 if gpu else sum(r.values())
        # pinned buffers (offload, vLLM's sleep copies) and async-save snapshots are kept once made
        host[phase] = per_node * (process + offloaded + asleep_host + ckpt["kept"] + device_on_host
                                  + phase_host.get(phase, 0.0) + planned.host_per_rank)
    if "build" in host:  # an FSDP role's rank 0 reads the whole fp32 model before sharding it
        host["build"] += planned.host_load
    host_limit = (node_memory_gb or cfg.slurm.mem_gb) * hardware.GB if (node_memory_gb or cfg.slurm.mem_gb) \
        else float(hardware.local_ram_bytes() if not gpu else 0)
    limit = gpu_total if gpu else host_limit
    if gpu and gpu_total <= 0:
        notes.append("GPU memory unknown: set slurm.gpu_type or pass --gpu-memory-gb")
    if not gpu and not (node_memory_gb or cfg.slurm.mem_gb):
        notes.append("CPU job: node RAM taken as this machine's (slurm.mem_gb is 0)")
    notes += _vllm_notes(cfg, group, gpu, asleep)
    return MemoryPlan(table, host, limit, host_limit, "gpu" if gpu else "cpu", stage, per_node, notes,
                      group=group, ranks=_group_ranks(cfg, group), blocking=blocking)


def judge_bytes(cfg, gpu: bool, gpu_total: float, allow_known: bool):
    """(bytes while it scores, bytes while idle) of the generative judge on a training rank's
    device (on a CPU: the host's, which is the device). vLLM: judge.gpu_memory_utilization x the
    GPU, asleep (level 1) between steps: nothing on the device; HF generate: its weights (bf16 on a
    GPU, moved to the host while idle; fp32 on a CPU, resident)."""
    rm = cfg.reward.reward_model
    if not (rm.enable and rm.kind == "judge" and rm.path):
        return 0.0, 0.0
    if gpu and rm.judge.uses_vllm(gpu):
        return rm.judge.gpu_memory_utilization * gpu_total, 0.0
    params = float(total_params(model_arch(rm.path, allow_known=allow_known, field="reward.reward_model.path")))
    return (2.0 * params, 0.0) if gpu else (4.0 * params, 4.0 * params)


def judge_note(cfg, gpu: bool, awake: float) -> str:
    engine = "vLLM" if awake and gpu and cfg.reward.reward_model.judge.engine != "hf" else "HF generate"
    return (f"generative judge ({engine}): {awake / 2**30:.2f} GiB while it scores (the reward_score row), "
            + ("asleep otherwise" if gpu else "resident throughout"))


def _vllm_notes(cfg, group: str, gpu: bool, asleep: bool) -> List[str]:
    if group == "rollout":
        return ["split placement: the rollout ranks hold only vLLM, awake throughout (no sleep mode)"]
    if group == "training":
        return ["split placement: the training ranks hold only the Megatron roles (no vLLM)"]
    if gpu and not asleep:
        return ["rollout.sleep_between_phases is off: vLLM keeps its whole budget during training"]
    if gpu and asleep:
        return [f"vLLM sleep level {sleep_level(cfg)}; two-stage wake (weights, then KV cache)"]
    return []


def _rollout_rows(row, budget: float, resharding: float) -> Dict[str, Dict[str, float]]:
    """A split job's rollout rank: vLLM's whole budget in every phase; during a weight update it
    also holds the received buckets (the same bound as the trainer's side)."""
    return {"startup": row({}, {}, budget), "weight_sync": row({}, {"resharding": resharding}, budget),
            "rollout": row({}, {}, budget)}


def _training_rows(cfg, roles, row, one_role_at_a_time, forward_working, activations, budget: float,
                   vllm_sync: float, vllm_idle: float, resharding: float) -> Dict[str, Dict[str, float]]:
    """The rows of a rank that trains (colocated: and rolls out, vLLM's bytes as given)."""
    table = {
        # each role is built whole, then offloads what it offloads; the actor is the largest
        "build": row({"actor": "train"}, {}, 0.0),
        # vLLM starts last and needs gpu_memory_utilization x total free
        "startup": row({}, {}, budget),
        # every step's lazy sync, first wake stage: vLLM's weights mapped, not its KV cache; the
        # actor's weights resident for the whole sync; the resharding buckets
        "weight_sync": row({"actor": "forward"}, {"resharding": resharding}, vllm_sync),
        # generation: vLLM awake (weights, KV cache, CUDA graphs); the Megatron roles idle
        "rollout": row({}, {}, budget),
        # the reward model's scores: the scorer's forward (batched as the actor's), or the judge awake
        "reward_score": row({"reward": "forward"}, forward_working(cfg.actor, "value", "reward")
                            if "reward" in roles else {}, vllm_idle),
        "old_logprob": row({"actor": "forward"}, forward_working(cfg.actor, "lm", "actor"), vllm_idle),
        "ref_logprob": row({"ref": "forward"}, forward_working(cfg.actor, "lm", "ref"), vllm_idle),
        # on-policy distillation: the teacher's forward, batched as the actor's
        "teacher_logprob": row({"teacher": "forward"}, forward_working(cfg.actor, "lm", "teacher"), vllm_idle),
        # PRIME: the PRM's forward (its rewards, before and after its update) and its update
        "prm_logprob": row({"prm": "forward"}, forward_working(cfg.prm, "lm", "prm"), vllm_idle),
        "update_prm": row({"prm": "train"}, activations(cfg.prm, "lm", "prm"), vllm_idle),
        "values": row({"critic": "forward"}, forward_working(cfg.critic, "value", "critic"), vllm_idle),
        "update_critic": row({"critic": "train"}, activations(cfg.critic, "value", "critic"), vllm_idle),
        "update_actor": row({"actor": "train"}, activations(cfg.actor, "lm", "actor"), vllm_idle),
        # after the step, vLLM asleep: the save copies slab by slab from the resident tensors to
        # host buffers (host.py), nothing is staged on the device
        "checkpoint": one_role_at_a_time({}),
        # the reload (trainer.rollback): the same residency; the reader fills the device tensors
        # from host buffers (host.py)
        "rollback": one_role_at_a_time({}),
    }
    if not cfg.ref.enable:
        del table["ref_logprob"]
    elif "ref" not in roles:  # LoRA: the reference is the actor's own base, adapters off
        table["ref_logprob"] = row({"actor": "forward"}, forward_working(cfg.actor, "lm", "actor"), vllm_idle)
    if "teacher" not in roles:
        del table["teacher_logprob"]
    if not cfg.reward.reward_model.enable:
        del table["reward_score"]
    if "critic" not in roles:
        del table["values"], table["update_critic"]
    if "prm" not in roles:
        del table["prm_logprob"], table["update_prm"]
    elif cfg.prm.update == "none":
        del table["update_prm"]
    if not cfg.trainer.rollback.enable:
        del table["rollback"]
    return table
