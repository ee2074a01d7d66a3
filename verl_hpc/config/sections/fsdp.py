"""`fsdp:` the second training engine (PyTorch FSDP2, verl_hpc/engines/fsdp/), and the rule that
picks an engine for a role (`parallel.engine`).

Which engine trains a role is chosen once, where the roles are built (verl_hpc/trainer/roles.py):
`parallel.engine` names it for every role, or `auto` decides per role from the role's own model
folder: Megatron-Core where the architecture is one the project maps into Megatron and the layout
asks for tensor, pipeline or expert parallelism (what only Megatron has), else FSDP2, which trains
any model as transformers builds it. The rule is `choose_engine`, written once and called from the
config check (login node, when the folder is readable) and from the role builder.

Why one field for the job rather than one per role: the roles of a job share its ranks and its
layout (`parallel.*`), and a checkpoint resumes in either engine (one coordinate system), so the
choice that matters is the layout's; `auto` still sends a role whose folder Megatron cannot map
(a critic or reward model of another family) to FSDP on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.fields import Section, opt

MEGATRON, FSDP = "megatron", "fsdp"  # the engines by name, for code that defaults to one
ENGINES = ("auto", MEGATRON, FSDP)
MIXED_PRECISION = ("auto", "fp32", "bf16", "fp16")


@dataclass
class FsdpConfig(Section):
    shard_size: int = opt(0, "ranks one copy of the model is sharded over (FSDP2 over a DeviceMesh); the "
                             "others hold replicas of that shard (HSDP: a replicate x shard mesh, gradients "
                             "all-reduced across replicas). 0 = every training rank (plain FSDP); on a "
                             "multi-node job set it to the GPUs of one node", check=">=0")
    reshard_after_forward: bool = opt(True, "free each layer's gathered weights after its forward and "
                                            "gather them again for the backward (ZeRO-3); false keeps them "
                                            "(ZeRO-2: more memory, one all-gather less per layer)")
    mixed_precision: str = opt("auto", "compute dtype; the master weights, optimizer states and gradient "
                                       "reduction stay fp32. auto: model.dtype on GPUs (bf16 or fp16), fp32 on CPU; "
                                       "fp16 scales the loss (actor.optim.*loss_scale*)",
                               choices=MIXED_PRECISION)
    activation_checkpointing: bool = opt(False, "recompute each decoder layer's activations in the backward "
                                                "(memory of one layer's activations instead of all)")
    cpu_offload: bool = opt(False, "FSDP2's CPU offload policy: the sharded parameters, gradients and "
                                   "optimizer states live on the host even while training (the step runs "
                                   "on the CPU); for a model that does not fit while it trains. An idle "
                                   "role's offload between phases is <role>.param_offload / optimizer_offload")
    sp: int = opt(1, "Ulysses sequence parallelism: ranks that share each sequence (consecutive ranks, "
                     "e.g. the GPUs of one node). Each holds 1/sp of every sequence's tokens and "
                     "activations; attention regroups by heads with two all-to-alls per layer. Must "
                     "divide the training ranks and the model's attention heads; the data-parallel "
                     "size is then ranks / sp", check=">0")
    compile: Optional[bool] = opt(False, "torch.compile each decoder layer after sharding (needs a C++ compiler "
                                         "on CPU, Triton on GPUs); null = auto: on with a GPU and Triton, off on "
                                         "CPU (engines/fsdp/build.py compile_choice); false until a GPU run has "
                                         "measured it (docs/speed.md)")
    liger: Optional[bool] = opt(None, "Liger-Kernel's fused RMSNorm, SwiGLU and linear cross-entropy (an "
                                      "update's log-probs); null = auto: on with a GPU and liger-kernel "
                                      "installed, off on CPU (engines/fsdp/liger.py)")

    def check(self, job) -> List[str]:
        p = []
        world = job.train_world_size
        if self.shard_size and world and world % self.shard_size:
            p.append(f"fsdp.shard_size = {self.shard_size} must divide the {world} training ranks "
                     f"(replicas x shard size); valid: a divisor of {world}, or 0 for all of them")
        # that sp tiles the training ranks is the layout's rule (config/layout.py: a group is one
        # data-parallel rank)
        if self.sp > 1 and job.parallel.engine != "fsdp":
            p.append(f"fsdp.sp = {self.sp} is the FSDP engine's sequence parallelism: set parallel.engine=fsdp "
                     f"(parallel.engine = {job.parallel.engine}); with Megatron, split long sequences with "
                     "parallel.cp (context parallelism)")
        if self.cpu_offload and job.slurm.gpus_per_node == 0:
            p.append("fsdp.cpu_offload = true needs GPUs (it keeps the sharded states on the host while the GPUs "
                     "compute), but slurm.gpus_per_node = 0 (a CPU job: everything is on the host already); set "
                     "fsdp.cpu_offload=false")
        if self.liger is True and job.slurm.gpus_per_node == 0:
            p.append("fsdp.liger = true needs GPUs (Liger's kernels are Triton), but slurm.gpus_per_node = 0 "
                     "(a CPU job): set it to null (auto) or false")
        if job.parallel.engine == "fsdp":
            p += engine_layout_problems("fsdp", job)
        return p


def sp_head_problems(sp: int, heads: int, kv_heads: int) -> List[str]:
    """Ulysses' rule on the model's heads (engines/fsdp/ulysses.py; written here, without torch,
    so that the config check and the memory planner apply it too): the query heads split evenly
    over the sp ranks; the KV heads split too, or, fewer than sp, are each repeated sp / kv times."""
    if sp <= 1 or not heads:
        return []
    kv = kv_heads or heads
    if heads % sp:
        return [f"fsdp.sp = {sp} must divide the model's {heads} attention heads (Ulysses gives each rank "
                f"heads/sp of them); valid: a divisor of {heads}"]
    if kv % sp and sp % kv:
        return [f"fsdp.sp = {sp} and the model's {kv} KV heads: one must divide the other (KV heads are split "
                f"over the group, or each repeated sp/kv times when fewer); valid: a divisor or multiple of "
                f"{kv} that divides {heads}"]
    return []


def engine_layout_problems(engine: str, job) -> List[str]:
    """Combinations of the FSDP engine with layout fields that it does not have, one line each."""
    if engine != "fsdp":
        return []
    par, why = job.parallel, "parallel.engine = fsdp"
    p = []
    if par.pp > 1:
        p.append(f"{why} with parallel.pp = {par.pp}: FSDP has no pipeline parallelism; set parallel.pp=1 "
                 "or parallel.engine=megatron")
    if par.ep > 1:
        p.append(f"{why} with parallel.ep = {par.ep}: FSDP has no expert parallelism; set parallel.ep=1 "
                 "or parallel.engine=megatron")
    if par.tp > 1:
        p.append(f"{why} with parallel.tp = {par.tp}: the FSDP engine has no tensor parallelism; set "
                 "parallel.tp=1 (fsdp.shard_size shards instead) or parallel.engine=megatron")
    if par.sequence_parallel:
        p.append(f"{why} with parallel.sequence_parallel = true: that is Megatron's; set it false")
    if job.model.fp8:
        p.append(f"{why} with model.fp8 = true: FP8 training is the Megatron engine's (Transformer "
                 "Engine); set model.fp8=false or parallel.engine=megatron")
    return p


def megatron_maps(model_path: str, field: str = "model.path") -> Optional[str]:
    """None when the folder's architecture is one verl_hpc maps into Megatron, else why not (the
    config.json's architecture named). Reads config.json only (no torch)."""
    from verl_hpc.config.hf_model import MEGATRON_ARCHITECTURES as ARCHITECTURES, read_hf_config

    data = read_hf_config(model_path, field)
    archs = data.get("architectures") or []
    name = archs[0] if len(archs) == 1 else data.get("model_type")
    known = name in ARCHITECTURES or name in set(ARCHITECTURES.values())
    return None if known else f"{name or 'an unnamed architecture'} is not mapped into Megatron"


def choose_engine(engine: str, model_path: str, parallel, field: str = "model.path") -> str:
    """megatron | fsdp for a role whose model is `model_path`, under parallel.engine = `engine`.
    auto: Megatron where the architecture is mapped and the layout asks for TP/PP/EP, else FSDP.
    An explicit choice is taken as it is (Megatron's own mapping refuses an unmapped
    architecture, naming parallel.engine=fsdp as the way out)."""
    if engine not in ENGINES:
        raise ConfigError(f"parallel.engine = {engine!r}; valid: {', '.join(ENGINES)}")
    if engine != "auto":
        return engine
    unmapped = megatron_maps(model_path, field)
    model_parallel = parallel.tp > 1 or parallel.pp > 1 or parallel.ep > 1
    if unmapped and model_parallel:
        raise ConfigError(f"parallel.engine = auto: {field}: {unmapped}, and FSDP has no tensor, pipeline "
                          f"or expert parallelism (parallel.tp = {parallel.tp}, pp = {parallel.pp}, "
                          f"ep = {parallel.ep}); set them to 1 for the FSDP engine")
    return "megatron" if model_parallel else "fsdp"
