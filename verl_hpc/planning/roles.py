"""The training roles of a plan (actor, critic, reference, PRM) on one rank, each on its engine.

    roles = plan_roles(cfg, arch, stage, prec, setup, allow_known)
    roles.states["actor"].resident("train"); roles.tensors["actor"]  (host figures)
    roles.working("actor", cfg.actor, "lm", train=True)  -> {"activations", "logits", "gathered"}

Each role's engine is parallel.engine's choice for its model folder (model_shape.role_engine):
a Megatron role's states and activations follow training.py (TP/PP/VPP, distributed optimizer,
recompute, in-flight pipeline micro-batches), an FSDP role's follow fsdp.py (fp32 shards over the
shard group, the gathered units, transformers' layer activations).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

from verl_hpc.models.config_mapping import ModelArch, padded_vocab_size
from verl_hpc.planning import fsdp as fsdp_plan
from verl_hpc.planning import hardware
from verl_hpc.planning.host import RoleTensors
from verl_hpc.planning.model_shape import (fsdp_arch, lora_layer_params, model_arch, role_engine, stage_params,
                                           stage_tensor_sizes)
from verl_hpc.planning.vision import VisionShape, megatron_tower_bytes, vision_shape
from verl_hpc.planning.output_layer import output_chunk
from verl_hpc.planning.training import (ActivationSetup, Precision, cp_tokens, in_flight_factor, logits_bytes,
                                        model_state_bytes, stage_activation_bytes)


@dataclasses.dataclass
class RoleState:
    """Bytes of one role on one rank, and which parts it offloads while idle."""

    name: str
    parts: Dict[str, float]  # weights / grads / optimizer
    offload: Dict[str, bool]

    def resident(self, active: str) -> float:
        """active: 'idle' | 'forward' (weights needed) | 'state' (weights + optimizer: a checkpoint's
        save or reload) | 'train' (everything)."""
        total = 0.0
        for part, size in self.parts.items():
            needed = (active == "train" or (active == "forward" and part == "weights")
                      or (active == "state" and part != "grads"))
            total += size if needed or not self.offload.get(part, False) else 0.0
        return total

    def offloaded(self) -> float:
        """Host bytes while idle: gradients are dropped, not copied (every update zeroes them)."""
        return sum(size for part, size in self.parts.items()
                   if self.offload.get(part, False) and part != "grads")


# the role -> (its section's attribute, head, model path field) of a job config
ROLE_FIELDS = {"actor": ("model.path", "lm"), "ref": ("model.path", "lm"),
               "critic": ("critic.model_path", "value"), "prm": ("prm.model_path", "lm"),
               "teacher": ("teacher.model_path", "lm"), "reward": ("reward.reward_model.path", "value")}


@dataclasses.dataclass
class PlannedRoles:
    states: Dict[str, RoleState]
    tensors: Dict[str, RoleTensors]
    engines: Dict[str, str]  # role -> megatron | fsdp
    fsdp: Dict[str, fsdp_plan.FsdpRole]
    archs: Dict[str, ModelArch]
    work: Callable[..., Dict[str, float]]  # (name, role_cfg, head, train) -> working bytes
    actor_layers: int  # decoder layers on this rank of the actor (Megatron: the stage's)
    host_per_rank: float = 0.0  # fsdp.cpu_offload: the FSDP roles' states on the host, every phase
    host_load: float = 0.0  # rank 0's whole fp32 model read from the folder while an FSDP role builds

    def working(self, name: str, role_cfg, head: str, train: bool) -> Dict[str, float]:
        return self.work(name, role_cfg, head, train)

    trained: Dict[str, bool] = dataclasses.field(default_factory=dict)
    # a Megatron role's vision tower on this (first) stage: (its shape, whether it trains)
    vision: Dict[str, Tuple[VisionShape, bool]] = dataclasses.field(default_factory=dict)

    def trained_engines(self) -> Dict[str, tuple]:
        """role -> (engine, whether it trains): what decides the process groups the job makes."""
        return {n: (e, self.trained[n]) for n, e in self.engines.items()}


def _offload_flags(role_cfg) -> Dict[str, bool]:
    return {"weights": getattr(role_cfg, "param_offload", False),
            "grads": getattr(role_cfg, "grad_offload", False),
            "optimizer": getattr(role_cfg, "optimizer_offload", False)}


def _merge_teachers(out: PlannedRoles) -> None:
    """Several teachers (teacher.by_data_source) are one `teacher` column: their states add up (each
    keeps its weights unless teacher.param_offload), and the forward's working bytes are the largest
    teacher's (they run one after another)."""
    extra = [n for n in out.states if n.startswith("teacher:")]
    if not extra:
        return
    names = ["teacher", *extra]
    largest = max(names, key=lambda n: out.states[n].parts.get("weights", 0.0))
    parts: Dict[str, float] = {}
    for n in names:
        for part, size in out.states[n].parts.items():
            parts[part] = parts.get(part, 0.0) + size
    out.states["teacher"] = RoleState("teacher", parts, out.states["teacher"].offload)
    out.archs["teacher"] = out.archs[largest]
    if largest in out.fsdp:
        out.fsdp["teacher"] = out.fsdp[largest]
    out.engines["teacher"] = out.engines[largest]
    for n in extra:
        for table in (out.states, out.tensors, out.engines, out.fsdp, out.archs, out.trained):
            table.pop(n, None)


def _teacher_engine(cfg) -> str:
    """teacher.engine, with `actor` the engine the actor's folder gets (as the trainer builds it)."""
    return role_engine(cfg, cfg.model.path) if cfg.teacher.engine == "actor" else cfg.teacher.engine


def plan_roles(cfg, arch: ModelArch, stage: int, prec: Precision, setup: ActivationSetup,
               allow_known: bool, gpu: bool, microbatch_shape) -> PlannedRoles:
    """Every role this job builds (the reference only when no LoRA: then it is the actor's base;
    the distillation teacher, frozen, with its own folder's shape)."""
    par, lora = cfg.parallel, cfg.lora
    tp, pp, vpp = par.tp, par.pp, par.vpp or 0
    # the distributed optimizer shards over Megatron's dp x cp group (CP ranks hold replicas)
    dp = max(1, cfg.dp) * par.cp
    wanted = {"actor": (cfg.actor, True, cfg.model.path)}
    if cfg.critic.enable:
        wanted["critic"] = (cfg.critic, True, cfg.critic.model_path)
    if cfg.ref.enable and not lora.enabled:
        wanted["ref"] = (cfg.ref, False, cfg.model.path)
    if cfg.trainer.job == "rl" and cfg.prm.enable:
        wanted["prm"] = (cfg.prm, cfg.prm.update != "none", cfg.prm.model_path)
    if cfg.trainer.job == "rl" and cfg.teacher.enable:  # one frozen engine per distinct teacher folder
        for i, folder in enumerate(dict.fromkeys(cfg.teacher.folders().values())):
            wanted["teacher" if i == 0 else f"teacher:{folder}"] = (cfg.teacher, False, folder)
    rm = cfg.reward.reward_model
    if rm.enable and rm.kind == "scorer" and rm.path:  # frozen, on the training ranks (the judge: judge_bytes)
        wanted["reward"] = (rm, False, rm.path)
    out = PlannedRoles({}, {}, {}, {}, {}, lambda *a: {}, 0)
    mega_layers = {}
    for name, (role_cfg, trainable, path) in wanted.items():
        field, head = ROLE_FIELDS[name.split(":")[0]]
        path = path or cfg.model.path
        engine = out.engines[name] = _teacher_engine(cfg) if name.startswith("teacher") else role_engine(cfg, path, field)
        out.trained[name] = trainable
        same = path == cfg.model.path
        off = _offload_flags(role_cfg)
        if engine == "fsdp":
            a = arch if same else fsdp_arch(path, allow_known=allow_known, field=field)
            on_lora = lora.enabled and name == "actor"
            vision = vision_shape(path, field) if head == "lm" else None
            fr = fsdp_plan.fsdp_role(cfg, a, head, trainable, lora.rank if on_lora else 0, lora.target_modules,
                                     vision)
            shard = fsdp_plan.shard_size(cfg)
            parts = dict(fr.parts)
            sizes = fsdp_plan.host_sizes(fr.params, shard)
            if cfg.fsdp.cpu_offload and gpu:  # FSDP2 pins each weight and grad shard; Adam's are plain
                shards = sum(hardware.pinned(n * 4) for n in sizes)
                out.host_per_rank += shards * (2 if parts["grads"] else 1) + parts["optimizer"]
                parts = {k: 0.0 for k in parts}
            out.states[name], out.fsdp[name], out.archs[name] = RoleState(name, parts, off), fr, a
            # rank 0 reads the whole model from the folder (fp32, on the host) before sharding it
            out.host_load = max(out.host_load, 4.0 * (fr.params.total + (vision.params if vision else 0)))
            out.tensors[name] = RoleTensors(name, sizes, 4, trainable and not on_lora, 1, 1, 2, off,
                                            buffers=[4.0 * n for n in sizes])
            continue
        a = arch if same else model_arch(path, allow_known=allow_known, field=field)
        params = stage_params(a, tp, pp, stage, head, par.ep, par.etp)
        adapter = (params.layers * lora_layer_params(a, lora.rank, lora.target_modules, tp)
                   if lora.enabled and name == "actor" else 0)
        parts = model_state_bytes(params, prec, trainable=trainable, dp=dp,
                                  distributed_optimizer=par.use_distributed_optimizer, adapter=adapter,
                                  edp=cfg.layout.edp or dp)
        frozen_tensors = not trainable or bool(adapter)  # LoRA: the base is a frozen role's tensors
        shard = dp if par.use_distributed_optimizer else 1
        out.tensors[name] = RoleTensors(name, stage_tensor_sizes(a, tp, pp, stage, head, par.ep, par.etp),
                                        prec.param_bytes, not frozen_tensors, vpp or 1, shard,
                                        2 + int(prec.master_copy), off)
        vision = vision_shape(path, field) if a.vision is not None and stage == 0 and head == "lm" else None
        if vision is not None:  # Qwen2.5-VL: transformers' tower on the first stage (planning/vision.py)
            trains = trainable and cfg.vision.train_vision_tower and not adapter
            tower = megatron_tower_bytes(vision, prec.param_bytes, prec.master_copy, trains=trains, dp=dp,
                                         distributed_optimizer=par.use_distributed_optimizer)
            parts = {k: parts[k] + tower[k] for k in parts}
            if trains or not trainable:  # a frozen tower beside a trained model has no optimizer state
                out.tensors[name].sizes.append(vision.params)
            out.vision[name] = (vision, trains)
        out.states[name], out.archs[name] = RoleState(name, parts, off), a
        mega_layers[name] = params.layers
    _merge_teachers(out)
    out.actor_layers = mega_layers.get("actor", arch.num_layers)
    out.work = _working(cfg, out, arch, stage, prec, setup, microbatch_shape)
    return out


def _working(cfg, roles: PlannedRoles, arch: ModelArch, stage: int, prec: Precision, setup: ActivationSetup,
             microbatch_shape):
    """A Megatron role's activations are counted on the actor's shape and layers on this stage; the
    distillation teacher's forward on its own shape (it may be much larger than the student)."""
    par = cfg.parallel
    tp, pp, vpp = par.tp, par.pp, par.vpp or 0
    last = stage == pp - 1

    def work(name: str, role_cfg, head: str, train: bool) -> Dict[str, float]:
        s, b, m = microbatch_shape(role_cfg, cfg)
        fr: Optional[fsdp_plan.FsdpRole] = roles.fsdp.get(name)
        if fr is not None:
            return fr.working(s, b, train)
        s = cp_tokens(s, par.cp)  # context parallel: this rank's share of each row
        layers = roles.actor_layers
        a = roles.archs.get(name, arch) if name == "teacher" else arch
        vocab = padded_vocab_size(a.vocab_size, tp)
        setting = cfg.model.logits_chunk_tokens if par.cp == 1 else 0  # cp: the whole logits' results gathered

        def logits(free_bytes: Optional[float] = None) -> float:
            """The logits term once the row knows what the rest leaves free (phases.py; None: a CPU)."""
            chunk = output_chunk(setting, vocab // tp, s * b, prec.act_bytes, free_bytes)
            return logits_bytes(a, s * b, tp, prec.act_bytes, head, vocab, chunk) if last else 0.0

        if not train:  # no_grad: nothing is saved; one layer's intermediates and the logits
            one = stage_activation_bytes(a, 1, s, b, prec.act_bytes,
                                         dataclasses.replace(setup, recompute="none"))["saved"]
            return {"activations": one + images(name, b, False), "logits": logits}
        acts = stage_activation_bytes(arch, layers, s, b, prec.act_bytes, setup, last)
        factor = in_flight_factor(pp, vpp, m) if stage == 0 else 1.0
        return {"activations": (acts["saved"] + images(name, b, train)) * factor + acts["recompute_working"],
                "logits": logits}

    def images(name: str, b: int, train: bool) -> float:
        """A Megatron role's images per micro-batch on the first stage: the largest images' pixel values
        and its tower's activations (every block's where the tower trains, else one block's)."""
        if name not in roles.vision:
            return 0.0
        v, trains = roles.vision[name]
        return cfg.vision.max_images_per_prompt * b * v.image_bytes(prec.act_bytes, train and trains)

    return work


def fsdp_notes(cfg, roles: PlannedRoles) -> List[str]:
    notes = []
    if roles.vision:
        v, trains = next(iter(roles.vision.values()))
        notes.append(f"vision tower (Megatron engine, first pipeline stage, whole on every TP rank): {v.params / 1e6:.1f} M "
                     f"parameters ({'trained: fp32 gradients, Adam sharded over DP' if trains else 'frozen'}); up to "
                     f"{v.tokens_per_image} image tokens per image ({v.patches_per_image} patches), "
                     f"{cfg.vision.max_images_per_prompt} image(s) per row at most (vision.max_images_per_prompt)")
    if not roles.fsdp:
        return notes
    return notes + fsdp_plan.offload_notes(cfg, roles.fsdp)
