"""The model of an FSDP engine: the one transformers builds from the folder, sharded with FSDP2.

    model = load_model(options, device)        # AutoModelForCausalLM, or a backbone + value head
    mesh = make_mesh(options.fsdp, device)     # (shard,) or (replicate, shard) for HSDP
    shard_model(model, mesh, options, compute_dtype)

Loading (`load_model`): every rank builds the architecture on the meta device (no memory), rank 0
alone reads the weights with `from_pretrained`, and after sharding torch's
`set_model_state_dict(..., broadcast_from_rank0=True)` sends each rank only its shard (what verl
and torchtitan do): a node's host memory holds one full copy of the model, not one per rank.
Buffers that are not in a state dict (RoPE's inverse frequencies) are computed by rank 0's model
and broadcast. The weights are fp32 (the master copy); `fsdp.mixed_precision` sets the compute
dtype (`MixedPrecisionPolicy`: bf16 or fp16 parameters in forward and backward, fp32 gradient
reduction; fp16 with a dynamic loss scale, optim.py).

A critic or reward model (`head = "value"`) is the folder's backbone (`AutoModel`, i.e. the causal
LM without its vocabulary projection) and a `score` projection hidden -> 1 without bias: HF's
`score.weight` of a *ForSequenceClassification folder when there is one, else N(0, 0.02) from the
same seed as the Megatron engine's value head, so both engines start the same critic.

Sharding (`shard_model`): `fully_shard` on each module class transformers itself names as not to
be split (`_no_split_modules`: the decoder layers, a vision tower's blocks), then on the root
(embeddings, final norm, output layer). Gradients are SUMMED over the ranks (divide factor 1):
the engine's loss contributions are already normalised by the whole batch's counts
(verl_hpc/engines/base.py), as the Megatron engine's DDP sums them.
"""
from __future__ import annotations

import logging
import shutil
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.hf_model import is_vision_language
from verl_hpc.engines.options import HEADS, VALUE_HEAD_SEED, EngineOptions, check_float16_here
from verl_hpc.models.dropout import zero_config_dropout, zero_module_dropout
from verl_hpc.runtime.device import has_gpu

log = logging.getLogger(__name__)
SCORE_NAME = "score.weight"


class ValueModel(torch.nn.Module):
    """A decoder backbone (`model`) and `score`: hidden -> 1, per position. Parameter names are
    the HF ones of a *ForSequenceClassification model (model.*, score.weight)."""

    def __init__(self, backbone: torch.nn.Module, hidden: int):
        super().__init__()
        self.model = backbone
        self.score = torch.nn.Linear(hidden, 1, bias=False)
        self.config = backbone.config
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)

    def forward(self, input_ids, position_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.score(hidden)


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(fsdp, model_dtype: str) -> torch.dtype:
    """fsdp.mixed_precision -> the dtype forward and backward run in (the weights stay fp32).
    float16 brings the loss scaler with it (optim.py, LossScaler)."""
    mp = fsdp.mixed_precision
    if mp == "auto":
        return getattr(torch, model_dtype) if has_gpu() else torch.float32
    return COMPUTE_DTYPES[mp]


def check_fsdp_options(o: EngineOptions) -> None:
    """What the config cannot know: the wiring of the options, and this machine's compiler."""
    if o.head not in HEADS:
        raise ValueError(f"engine head: {o.head!r}; valid: {', '.join(HEADS)}")
    if o.trainable and o.optim is None:
        raise ValueError("a trainable engine needs its optim section (actor.optim / critic.optim / prm.optim)")
    if o.fp8:
        raise ConfigError("model.fp8 = true: FP8 training is the Megatron engine's (Transformer Engine); "
                          "set model.fp8=false or parallel.engine=megatron")
    check_compile(o.fsdp)
    if o.fsdp.mixed_precision == "fp16":  # auto computes in fp32 on a CPU (compute_dtype)
        check_float16_here("float16", "fsdp.mixed_precision = fp16 on a machine without a GPU",
                           "fsdp.mixed_precision=auto (fp32 on a CPU)")


def compile_choice(setting, *, gpu: bool, triton: bool, cxx: bool):
    """(compile each decoder layer, why) for fsdp.compile = `setting`. true: needs inductor's
    compiler (Triton on GPUs, a C++ compiler on CPU), refused in one line where it is missing;
    false: off; null (auto): on with a GPU and Triton, off on a CPU (compiling there costs more
    than it saves on a short job, and the CPU suite's figures are the eager path's). The default
    stays false until a GPU run has measured it (docs/speed.md)."""
    if setting is False:
        return False, "fsdp.compile = false"
    if setting is True:
        if gpu and not triton:
            raise ConfigError("fsdp.compile = true needs Triton on GPUs (torch.compile's GPU backend); "
                              "install the triton that matches torch or set fsdp.compile=false")
        if not gpu and not cxx:
            raise ConfigError("fsdp.compile = true needs a C++ compiler on a CPU machine (torch.compile's "
                              "inductor builds C++ kernels) and none of g++, c++, clang++ is on PATH; install "
                              "one (apt-get install g++) or set fsdp.compile=false")
        return True, "fsdp.compile = true"
    if not gpu:
        return False, "fsdp.compile = auto: off on a CPU"
    if not triton:
        return False, "fsdp.compile = auto: off, Triton is not installed"
    return True, "fsdp.compile = auto: a GPU and Triton"


def compile_on(fsdp) -> bool:
    """Whether this rank compiles each decoder layer (compile_choice on this machine)."""
    import importlib.util

    return compile_choice(fsdp.compile, gpu=has_gpu(), triton=importlib.util.find_spec("triton") is not None,
                          cxx=any(shutil.which(c) for c in ("g++", "c++", "clang++")))[0]


def check_compile(fsdp) -> None:
    """fsdp.compile = true needs inductor's compiler: a C++ compiler on CPU, Triton on GPUs."""
    compile_on(fsdp)


def hf_config(path: str, trust_remote_code: bool, field: str):
    """The folder's transformers config, or one line naming the folder, its architecture and what
    went wrong (also the submitter's check of a folder the FSDP engine trains)."""
    from transformers import AutoConfig

    from verl_hpc.config.hf_model import read_hf_config

    data = read_hf_config(path, field)  # the folder and its config.json, named
    arch = (data.get("architectures") or [data.get("model_type", "?")])[0]
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ConfigError(f"{field}: '{path}' ({arch}) ships its own modelling code, which runs only "
                              "with model.trust_remote_code=true (it executes code from the folder)") from None
        raise ConfigError(f"{field}: transformers cannot load '{path}' ({arch}): {_first_sentence(e)}; valid: "
                          "a model_type this transformers knows, or a folder with its own code and "
                          "model.trust_remote_code=true") from None
    except (OSError, KeyError) as e:
        raise ConfigError(f"{field}: transformers cannot load '{path}' ({arch}): {_first_sentence(e)}") from None


def _first_sentence(e: BaseException) -> str:
    """transformers' messages run to several sentences and lines of advice; the first says what."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(". ")[0].rstrip(".")


def _auto_class(head: str, config):
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    if is_vision_model(config):
        if head == "value":
            raise ConfigError(f"{type(config).__name__} is a vision-language model: a value or reward head on "
                              "one is not supported (critic.model_path / reward.reward_model.path must be a "
                              "text model); the policy and its reference train as transformers builds them")
        return AutoModelForImageTextToText
    if head == "value":
        return AutoModel
    if type(config) not in AutoModelForCausalLM._model_mapping and not hasattr(config, "auto_map"):
        raise ConfigError(f"model.path: {type(config).__name__} has no causal-LM class in transformers "
                          "(AutoModelForCausalLM); the FSDP engine trains causal language models")
    return AutoModelForCausalLM


def _value_head_init(path: str, hidden: int) -> torch.Tensor:
    """score.weight from the folder, else the Megatron engine's seeded N(0, 0.02)."""
    from verl_hpc.models.hf_checkpoint import HFCheckpointReader, WeightFileError

    reader = HFCheckpointReader(path)
    if SCORE_NAME in reader:
        score = reader.read(SCORE_NAME).float()
        if tuple(score.shape) != (1, hidden):
            raise WeightFileError(f"{path}: {SCORE_NAME} has shape {tuple(score.shape)}; a value head needs "
                                  f"(1, {hidden})")
        return score
    gen = torch.Generator().manual_seed(VALUE_HEAD_SEED)
    return 0.02 * torch.randn(1, hidden, generator=gen)


def _build(cls, config, head: str, trust_remote_code: bool, path: Optional[str], no_dropout: bool = True):
    """The module: from the folder's weights when `path` is given (rank 0), else on meta; without
    dropout modules where `no_dropout` (model.disable_dropout)."""
    kwargs = dict(trust_remote_code=trust_remote_code, attn_implementation=attention_implementation(cls, config),
                  dtype=torch.float32)
    if path is not None:
        model = _from_pretrained(cls, path, config, kwargs)
    else:
        with torch.device("meta"):
            model = cls.from_config(config, **kwargs)
    if no_dropout:
        zero_module_dropout(model)  # model code with a rate of its own, not the config's
    train_pad_row(model)
    if head != "value":
        return model
    hidden = config.hidden_size
    value = ValueModel(model, hidden)
    if path is not None:
        with torch.no_grad():
            value.score.weight.copy_(_value_head_init(path, hidden))
    else:
        value.score.to("meta")
    return value


def attention_implementation(cls, config) -> str:
    """torch's SDPA where transformers has it for the architecture, else its own eager attention
    (BLOOM's ALiBi, GPT-OSS's attention sinks have no SDPA path): asking for SDPA there is an error.
    A model with its own code (auto_map) is asked for SDPA, as before."""
    from transformers.models.auto.auto_factory import _get_model_class

    try:
        model_cls = _get_model_class(config, cls._model_mapping)
    except (KeyError, ValueError, AttributeError):  # remote code: transformers does not know the class
        return "sdpa"
    return "sdpa" if getattr(model_cls, "_supports_sdpa", True) else "eager"


def train_pad_row(model: torch.nn.Module) -> None:
    """The pad token's embedding row trains like every other row, as in the Megatron engine.
    transformers builds the embedding with `padding_idx = pad_token_id`, which zeroes that row's
    gradient; but many tokenizers' pad token is a real token (SmolLM2's `<|im_end|>`, in every chat
    prompt), and the engines' padding never reaches a scored position (right-padded, causal; masked
    when packed), so the row's gradient is the real occurrences' alone. Left as transformers has it,
    the two engines' updates differed in that row."""
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
            m.padding_idx = None


def _from_pretrained(cls, path: str, config, kwargs):
    """from_pretrained, strict: transformers initialises a tensor the folder lacks at random (a log
    line, no error) and raises on a shape without naming it; here either is a ValueError naming
    the first tensor. A value model's backbone leaves the causal LM's lm_head.weight unused."""
    model, info = cls.from_pretrained(path, config=config, output_loading_info=True,
                                      ignore_mismatched_sizes=True, **kwargs)
    wrong = sorted(info.get("mismatched_keys") or (), key=lambda m: m[0])
    if wrong:
        name, found, want = wrong[0]
        raise ValueError(f"tensor '{name}' has shape {list(found)}, the model built from config.json has "
                         f"{list(want)}{_more(wrong)}; valid: the config.json these weights were saved with")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ValueError(f"no tensor '{missing[0]}'{_more(missing)}, which config.json implies (transformers "
                         "would start it at random); valid: weights saved with this config.json")
    return model


def _more(items) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def load_model(options, field: str = "model.path"):
    """(model on meta for every rank but 0, rank 0's loaded full model or None). Collective-free;
    `materialize` finishes the job after sharding."""
    from verl_hpc.engines.fsdp.folder_check import causal_lm_problem

    config = hf_config(options.model_path, options.trust_remote_code, field)
    problem = "" if options.head == "value" else causal_lm_problem(config, field, options.model_path)
    if problem:  # a masked LM would build through the mapping's decoder class and fail in generate
        raise ConfigError(problem)
    no_dropout = getattr(options, "disable_dropout", True)  # EngineOptions' field; the default for a bare namespace
    if no_dropout:  # before the modules are built: they read the rates from it
        zeroed = zero_config_dropout(config)
        if zeroed and (not dist.is_initialized() or dist.get_rank() == 0):
            log.info("dropout off (model.disable_dropout): %s of %s set to 0", ", ".join(zeroed), options.model_path)
    cls = _auto_class(options.head, config)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and attention_implementation(cls, config) != "sdpa":
        log.info("%s has no SDPA attention in transformers: its eager attention runs", type(config).__name__)
    skeleton = full = None
    # both builds inside the one-line error: the architecture (on meta, every rank), then the weights
    for path in (None, options.model_path) if rank0 else (None,):
        try:
            model = _build(cls, config, options.head, options.trust_remote_code, path, no_dropout)
        except (OSError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            what = "load the weights of" if path else "build the model of"
            raise ConfigError(f"{field}: transformers cannot {what} '{options.model_path}' "
                              f"({type(config).__name__}): {str(e).splitlines()[0]}") from None
        skeleton, full = (model, full) if path is None else (skeleton, model)
    return skeleton, full


def make_mesh(fsdp, device: torch.device):
    """The DeviceMesh FSDP shards over: (world,) or, with fsdp.shard_size < world, (replicate,
    shard) for HSDP (each shard group holds one copy; gradients are all-reduced across copies)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    shard = fsdp.shard_size or world
    if world % shard:
        raise ConfigError(f"fsdp.shard_size = {shard} must divide the {world} training ranks")
    if shard == world:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def is_vision_model(config) -> bool:
    """A transformers config object of a vision-language model (config.hf_model's rule)."""
    return is_vision_language(config.to_dict())


# where transformers' vision-language models keep the vision tower and the projector into the
# language model (Qwen-VL: model.visual with its merger; LLaVA-style: vision_tower + multi_modal_projector)
VISION_PARTS = ("visual", "vision_tower", "vision_model", "multi_modal_projector")


def vision_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.split(".")[-1] in VISION_PARTS]


def shard_units(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules FSDP shards one by one: instances of the classes transformers marks as not to
    be split (`_no_split_modules`), outermost first. A vision-language model's vision blocks are
    not units: they stay in the root's group, which every rank gathers in every forward, because a
    micro-batch without images skips the vision tower and per-block all-gathers would then run on
    some ranks only (a hang)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    inside_vision = {id(m) for v in vision_modules(model) for m in v.modules()}
    units = [m for m in model.modules() if type(m).__name__ in names and id(m) not in inside_vision]
    if not units:
        raise ConfigError(f"{type(model).__name__}: transformers names no decoder-layer class "
                          "(_no_split_modules) to shard by; the FSDP engine cannot split this model")
    return units


def shard_model(model: torch.nn.Module, mesh, fsdp, dtype: torch.dtype, *, activation_checkpointing: bool) -> None:
    """fully_shard per unit, then the root; summed gradients; optional recompute and compile."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", True):
            raise ConfigError(f"fsdp.activation_checkpointing: {type(model).__name__} does not support it "
                              "in transformers; set it false")
        target = model.model if isinstance(model, ValueModel) else model
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    kwargs: dict = dict(mesh=mesh, reshard_after_forward=fsdp.reshard_after_forward)
    if mp is not None:
        kwargs["mp_policy"] = mp
    if fsdp.cpu_offload:
        if mesh.device_type == "cpu":  # torch's policy copies to an accelerator: "Cannot access accelerator device"
            raise ConfigError("fsdp.cpu_offload = true needs GPUs; this rank has none (a CPU job keeps every "
                              "state on the host already): set fsdp.cpu_offload=false")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    units = shard_units(model)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a SUM: the loss is normalised by the whole batch
            # and as a plain SUM collective: gloo has no PREMUL_SUM (FSDP's op for a custom
            # factor), and NCCL's zero-copy path takes SUM only
            m.set_force_sum_reduction_for_comms(True)
    if compile_on(fsdp):
        for unit in units:
            unit.compile()


def param_home(fsdp, device: torch.device) -> torch.device:
    """Where the sharded parameters are materialized: the host under fsdp.cpu_offload (FSDP2's offload
    policy keeps them there and copies each unit to the device for its compute; materialized on the
    GPU they would stay there), else the rank's device."""
    return torch.device("cpu") if fsdp.cpu_offload else device


def materialize(model: torch.nn.Module, full: Optional[torch.nn.Module], device: torch.device) -> None:
    """Give the sharded meta model its storage and rank 0's weights (each rank receives its shard)
    and rank 0's buffers (RoPE tables: not in the state dict). `device`: param_home's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state = full.state_dict() if rank0 else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    if not dist.is_initialized():  # alone: load it as a full state dict into the local shards
        opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state, options=opts)
    source = dict(full.named_buffers()) if rank0 else {}
    for name, buf in model.named_buffers():
        if rank0:
            buf.copy_(source[name].to(buf.device, buf.dtype))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(buf, src=0)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(model: Any) -> str:
    cfg = getattr(model, "config", None)
    return type(cfg).__name__.replace("Config", "") if cfg is not None else type(model).__name__
