"""Bytes of one FSDP2 role on one rank (verl_hpc/engines/fsdp/): sharded states, the gathered
units, activations and logits. Pure Python, like the rest of the planner.

The engine builds the model as transformers does, in fp32, and `fully_shard`s each decoder layer,
then the root (embeddings, final norm, output layer or value head): ZeRO-3 over the shard group.

States, per parameter, over the shard group (`fsdp.shard_size`; 0 = every training rank): the
fp32 parameter itself (the master copy: mixed precision casts it for compute when it is gathered,
there is no second copy), its fp32 gradient and Adam's two fp32 moments: 4 + 4 + 8 = 16 bytes /
shard; a frozen role (reference, frozen PRM) 4 / shard. HSDP (shard size < world): world / shard
replicas each hold the whole model sharded over their own group, so the bytes divide by the shard
size, not by the world. FSDP2 pads each tensor's first dimension to a multiple of the shard size
(not counted: under a row per tensor). The gradient shards an update leaves stay until the next
update: an idle role holds them unless `<role>.grad_offload` drops them (as the Megatron engine's
grad buffers).

Gathered units (compute dtype c: `fsdp.mixed_precision`, auto = the model dtype on GPUs, fp32 on
CPU), as FSDP2 (torch 2.13) holds them, measured on this machine (docs/memory.md):
- forward: the root's weights (FSDP2 keeps the root gathered from its forward through the
  backward) and two layers' worth: the computing layer's unsharded weights and its all-gather
  buffer, freed only after the next layer's copy-out. `reshard_after_forward: false` keeps every
  layer gathered until its backward: all layers and one buffer. A shard group of one rank gathers
  nothing ahead (its units are copied in place): one layer, or all;
- update, the larger of two moments of the backward: (a) inside it, the root's weights, the output
  layer's and final norm's unsharded grads (the first the backward makes; the root reduce-scatters
  last), and per layer either the computing layer's weights + the next one's prefetched all-gather
  + the computing layer's unsharded grads (3 c per element), or, once FSDP2 has resharded its
  weights to reduce its grads, the prefetched layer + the grads + their fp32 reduce-scatter input
  (2 c + 4); without reshard every layer not yet through its backward stays gathered; (b) at its
  end, the root's unsharded grads and their fp32 reduce-scatter input, c + max(c, 4) per element.

Activations per decoder layer and micro-batch of s tokens x b rows: what transformers' layer code
saves for backward (Llama-style layer, SDPA attention; measured tensor by tensor on this machine,
docs/memory.md), in bytes per token with e = c:
- each RMSNorm: its input as fp32 (4 h: the input itself in fp32, a copy in bf16), the normalised
  and the weighted output (2 h e) and an fp32 rsqrt per row (4);
- attention: Q and K after RoPE, V (the SDPA inputs, GQA unexpanded), the attention output (the
  o_proj input): e (2 hq + 2 hkv); SDPA's fp32 log-sum-exp per head: 4 a;
- SwiGLU: gate, silu(gate), up and their product (the down_proj input): 4 f e.
`fsdp.activation_checkpointing` keeps each layer's input (s b h e) and rebuilds one layer's
activations during its backward. Beyond the layers: RoPE's cos and sin (2 s b d e) and the final
norm (4 h + h e + 4); the output layer's input and its scored positions' copy, and one chunk of
tokens' fp32 logits at a time (model.logits_chunk_tokens; with 0, the logits of the kept positions
in c and their two fp32 copies) are the logits column (training.logits_bytes).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from verl_hpc.planning.output_layer import output_chunk
from verl_hpc.models.config_mapping import ModelArch
from verl_hpc.planning.model_shape import layer_tensor_sizes
from verl_hpc.planning.training import logits_bytes, mlp_width, moe_dispatch_bytes
from verl_hpc.planning.vision import VisionShape



def shard_size(cfg) -> int:
    """Ranks one copy of the model is sharded over (fsdp.shard_size; 0 = every training rank)."""
    return max(1, cfg.fsdp.shard_size or cfg.train_world_size)


def replicas(cfg) -> int:
    return max(1, cfg.train_world_size // shard_size(cfg))


def compute_name(cfg) -> str:
    """The compute dtype (fp32 | bf16 | fp16): fsdp.mixed_precision, auto = model.dtype on a GPU
    job (the engine's rule, engines/fsdp/build.py compute_dtype), fp32 on a CPU job."""
    mp = cfg.fsdp.mixed_precision
    if mp != "auto":
        return mp
    half = {"bfloat16": "bf16", "float16": "fp16"}.get(cfg.model.dtype)
    return half if half and cfg.slurm.gpus_per_node > 0 else "fp32"


def compute_bytes(cfg) -> int:
    """Bytes per element of the compute dtype (compute_name). fp16 costs what bf16 does: its loss
    scaler is one scalar and a growth counter."""
    return 4 if compute_name(cfg) == "fp32" else 2


@dataclasses.dataclass(frozen=True)
class FsdpParams:
    """Unsharded element counts of one role's model, by FSDP unit."""

    layer: int  # one decoder layer
    layers: int
    root: int  # embeddings, final norm, output layer (or value head): the root unit
    tensors: List[int]  # every parameter tensor (for the host figures)
    out: int = 0  # of the root: the output layer (or value head) and final norm, first in a backward

    @property
    def total(self) -> int:
        return self.layer * self.layers + self.root


def fsdp_params(arch: ModelArch, head: str = "lm") -> FsdpParams:
    """transformers' layout: per layer the same tensors as Megatron's at TP 1 (q, k, v apart but
    the same count); the embedding [V, h] with the real vocabulary (no padding); the final norm;
    an untied lm_head [V, h] (a tied one is the embedding itself) or a value head [1, h]."""
    h, v = arch.hidden_size, arch.vocab_size
    layer = layer_tensor_sizes(arch, 1, 1, 1)
    root = [v * h, h]
    if head == "value":
        root.append(h)
    elif not arch.tie_word_embeddings:
        root.append(v * h)
    out = h + (h if head == "value" else v * h)  # a tied output layer's grad is the embedding's
    return FsdpParams(sum(layer), arch.num_layers, sum(root), layer * arch.num_layers + root, out)


def peft_layer_params(arch: ModelArch, rank: int, targets) -> int:
    """LoRA's adapter elements of one decoder layer as PEFT attaches them to transformers' modules
    (one A [r, in] and B [out, r] per projection): linear_qkv = q, k and v; linear_proj = o;
    linear_fc1 = gate and up; linear_fc2 = down."""
    d, nq, nkv, h, f = arch.head_dim, arch.num_attention_heads, arch.num_query_groups, \
        arch.hidden_size, arch.ffn_hidden_size
    per = {"linear_qkv": 3 * rank * h + rank * (nq + 2 * nkv) * d,
           "linear_proj": rank * nq * d + rank * h,
           "linear_fc1": 2 * (rank * h + rank * f),
           "linear_fc2": rank * f + rank * h}
    return sum(per[t] for t in targets)


def state_bytes(p: FsdpParams, shard: int, *, trainable: bool, adapter: int = 0) -> Dict[str, float]:
    """weights / grads / optimizer bytes on one rank (fp32 shards, see the module docstring).
    `adapter`: LoRA's elements (the whole model's): the base is frozen, the adapter trains."""
    w = 4.0 * (p.total + adapter) / shard
    if not trainable:
        return {"weights": w, "grads": 0.0, "optimizer": 0.0}
    trained = adapter or p.total
    return {"weights": w, "grads": 4.0 * trained / shard, "optimizer": 8.0 * trained / shard}


def gathered_bytes(p: FsdpParams, c: int, *, reshard_after_forward: bool, train: bool, shard: int = 2,
                   adapter_layer: int = 0) -> float:
    """The peak of what FSDP2 holds unsharded on one rank in a forward (train False) or over an
    update's forward and backward (module docstring). `adapter_layer`: LoRA's elements per layer
    (then only they have gradients)."""
    layer = p.layer + adapter_layer
    ahead = 1 if shard > 1 else 0  # an all-gather buffer beyond the unsharded layers (none alone)
    if not train:
        return float((p.root + ((1 if reshard_after_forward else p.layers) + ahead) * layer) * c)
    lora = adapter_layer > 0
    grads = adapter_layer if lora else layer  # one layer's unsharded gradients
    # in the backward the next layer is prefetched only where the forward resharded it
    ahead = ahead if reshard_after_forward else 0
    resident = 1 if reshard_after_forward else p.layers
    computing = (resident + ahead) * layer * c + grads * c
    reducing = (resident - 1 + ahead) * layer * c + grads * (c + 4)  # weights resharded first
    middle = p.root * c + (0 if lora else p.out) * c + max(computing, reducing)
    end = 0 if lora else p.root * (c + max(c, 4))  # the root's grads, then its reduce-scatter input
    return float(max(middle, end))


def layer_activation_bytes(arch: ModelArch, s: int, b: int, e: int) -> float:
    """Saved bytes of one transformers decoder layer for one micro-batch (module docstring). An
    MoE layer: a token's MLP width is its top_k experts and the shared expert, plus the router's
    and the dispatch copies (training.moe_dispatch_bytes; transformers' MoE code is not measured)."""
    h, a = arch.hidden_size, arch.num_attention_heads
    hq, hkv = a * arch.head_dim, arch.num_query_groups * arch.head_dim
    norms = 2 * ((4 + 2 * e) * h + 4)
    attention = e * (2 * hq + 2 * hkv) + 4 * a
    mlp = 4 * mlp_width(arch) * e
    return float(s * b * (norms + attention + mlp)) + moe_dispatch_bytes(arch, s, b, e)


def tail_bytes(arch: ModelArch, s: int, b: int, e: int) -> float:
    """Saved beyond the layers: RoPE's cos and sin, the final norm (fp32 input, normalised, rsqrt)."""
    return float(s * b * (2 * arch.head_dim * e + 4 * arch.hidden_size + arch.hidden_size * e + 4))


def activation_bytes(arch: ModelArch, s: int, b: int, e: int, *, checkpointing: bool) -> Dict[str, float]:
    """{"saved", "recompute_working"} of one micro-batch's training forward over all layers."""
    layer = layer_activation_bytes(arch, s, b, e)
    tail = tail_bytes(arch, s, b, e)
    if not checkpointing:
        return {"saved": arch.num_layers * layer + tail, "recompute_working": 0.0}
    return {"saved": arch.num_layers * s * b * arch.hidden_size * e + tail, "recompute_working": layer}


@dataclasses.dataclass
class FsdpRole:
    """What the phase table needs of one FSDP role: its states, and its working bytes."""

    arch: ModelArch
    params: FsdpParams
    parts: Dict[str, float]
    c: int
    reshard: bool
    checkpointing: bool
    head: str
    adapter_layer: int = 0
    shard: int = 2
    # a vision-language model (planning/vision.py): its tower, whether it trains, images per row at most
    vision: Optional[VisionShape] = None
    vision_trains: bool = False
    images_per_row: int = 0
    sp: int = 1  # fsdp.sp: each rank of a sequence-parallel group holds 1/sp of every sequence
    logits_chunk: Optional[int] = None  # model.logits_chunk_tokens (None = auto, 0 = the whole logits)

    def working(self, s: int, b: int, train: bool) -> Dict[str, float]:
        """The activations, logits and gathered columns of a micro-batch (train: an update with
        its saved activations; else a no_grad forward: one layer's intermediates); a VLM's images:
        `images_per_row` of the largest size in every row, the tower gathered whole (root group).
        Under sequence parallelism a rank's tokens are s / sp: its activations and logits too (the
        attention's regrouped q, k, v hold all tokens of 1/sp of the heads: the same bytes)."""
        s = -(-s // self.sp)
        if train:
            acts = activation_bytes(self.arch, s, b, self.c, checkpointing=self.checkpointing)
            act = acts["saved"] + acts["recompute_working"]
        else:
            act = layer_activation_bytes(self.arch, s, b, self.c)
        arch, tokens, c, head = self.arch, s * b, self.c, self.head
        setting = self.logits_chunk

        def logits(free_bytes: Optional[float] = None) -> float:
            """The logits term once the row knows what the rest leaves free (phases.py; None: a CPU)."""
            chunk = output_chunk(setting, arch.vocab_size, tokens, c, free_bytes)
            return logits_bytes(arch, tokens, 1, c, head, arch.vocab_size, chunk)

        gathered = gathered_bytes(self.params, self.c, reshard_after_forward=self.reshard, train=train,
                                  shard=self.shard, adapter_layer=self.adapter_layer)
        out = {"activations": act, "logits": logits, "gathered": gathered}
        if self.vision is not None:
            v = self.vision
            # the images' pixel values and the tower's activations count with the activations
            out["activations"] += b * self.images_per_row * v.image_bytes(self.c, train and self.vision_trains)
            out["gathered"] += v.params * self.c * (2 if train and self.vision_trains else 1)  # + its grads
        return out


def fsdp_role(cfg, arch: ModelArch, head: str, trainable: bool, lora_rank: int = 0,
              lora_targets=(), vision: Optional[VisionShape] = None) -> FsdpRole:
    """vision: a VLM's tower (the policy's): fp32 shards of its weights, and of its gradients and
    Adam's moments where vision.train_vision_tower trains it."""
    p = fsdp_params(arch, head)
    adapter_layer = peft_layer_params(arch, lora_rank, lora_targets) if lora_rank else 0
    shard = shard_size(cfg)
    parts = state_bytes(p, shard, trainable=trainable, adapter=adapter_layer * p.layers)
    tower_trains = trainable and cfg.vision.train_vision_tower
    if vision is not None:
        tower = state_bytes(FsdpParams(0, 0, vision.params, [vision.params]), shard, trainable=tower_trains)
        parts = {k: parts[k] + tower[k] for k in parts}
    return FsdpRole(arch, p, parts, compute_bytes(cfg), cfg.fsdp.reshard_after_forward,
                    cfg.fsdp.activation_checkpointing and trainable, head, adapter_layer, shard,
                    vision, tower_trains, cfg.vision.max_images_per_prompt if vision is not None else 0,
                    cfg.fsdp.sp, cfg.model.logits_chunk_tokens)


def host_sizes(p: FsdpParams, shard: int) -> List[float]:
    """Elements of each parameter's local shard (each its own storage for Adam's moments)."""
    return [n / shard for n in p.tensors]


def offload_notes(cfg, roles: Dict[str, Optional[FsdpRole]]) -> List[str]:
    fs = cfg.fsdp
    names = ", ".join(n for n, r in roles.items() if r is not None)
    shard, reps = shard_size(cfg), replicas(cfg)
    layout = f"HSDP: {reps} replicas x shard {shard}" if reps > 1 else f"FSDP over {shard} rank(s)"
    scaled = " with dynamic loss scaling" if compute_name(cfg) == "fp16" else ""
    out = [f"FSDP engine ({names}): {layout}; compute {compute_name(cfg)}{scaled}, "
           f"fp32 master weights, grads and Adam sharded; reshard_after_forward "
           f"{'on' if fs.reshard_after_forward else 'off (every layer stays gathered to its backward)'}"
           f"; activation checkpointing {'on' if fs.activation_checkpointing else 'off'}"]
    if fs.sp > 1:
        out.append(f"fsdp.sp = {fs.sp}: each sequence split over {fs.sp} ranks (Ulysses); activations and "
                   f"logits per rank are those of 1/{fs.sp} of its tokens; {cfg.train_world_size // fs.sp} "
                   "data-parallel group(s)")
    if fs.cpu_offload:
        out.append("fsdp.cpu_offload: the FSDP roles' sharded weights, grads and Adam states live on the host "
                   "(the optimizer step runs on the CPU); the device holds only what is gathered")
    vlm = next((r for r in roles.values() if r is not None and r.vision is not None), None)
    if vlm is not None:
        v = vlm.vision
        out.append(f"vision tower: {v.params / 1e6:.1f} M parameters ({'trained' if vlm.vision_trains else 'frozen'}; "
                   f"gathered whole in every forward), up to {v.tokens_per_image} image tokens per image "
                   f"({v.patches_per_image} patches), {v.image_bytes(vlm.c, vlm.vision_trains) / 2**20:.1f} MiB of "
                   f"pixel values and tower activations per image, {vlm.images_per_row} image(s) per row at most "
                   "(vision.max_images_per_prompt)")
    return out
