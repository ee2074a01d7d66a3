"""The sides of benchmarks/bench_gpu_step.py, one interface: build from an HF folder, `train(batch)`
(one optimizer step, returns the loss before it), `forward(batch)` (response log-probs),
`kernels()` (what runs, from the built modules) and `close()`; plus `profiled_ops`, the operator
names torch's profiler saw in one call (which attention backend, norm, optimizer kernel ran), and
`side_problem`, why a side cannot run here (the Megatron engine without megatron-core).

Sides: `EngineSide` (the Megatron engine), `FsdpSide` (the FSDP2 engine; no megatron import),
the peers `HFSide` and `HFLigerSide` (gpu_step_peers.py: plain transformers, and transformers with
Liger-Kernel as TRL's `use_liger_kernel` runs it), and variants of the engines that change one thing
each (the whole logits, the CPU's fixed chunk budget, per-block torch.compile, foreach AdamW, no
Liger). `side_problem` says why a side cannot run here: the Megatron sides without megatron-core,
the Liger sides without a GPU and liger-kernel (in a CPU rehearsal a stand-in package that says it
is one, `CPU_STAND_IN`, runs them: the tests), the compiled side where torch.compile cannot build.

Loss on both sides: the token-mean negative log-likelihood of the response tokens (every sequence
has the same prompt and response lengths here, so the two means agree).
"""
from __future__ import annotations

import dataclasses
import functools
import gc

import torch

# profiler operator names by what they tell: the aten op of an SDPA call names its backend
# (_scaled_dot_product_flash_attention, _efficient_attention, _cudnn_attention, ..._for_cpu)
OP_KINDS = {
    "attention": ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                  "fused_attn"),
    "norm": ("rms_norm", "layer_norm"),
    "optimizer": ("adam",),
    "grad_norm_clip": ("foreach_norm", "linalg_vector_norm", "foreach_mul"),  # foreach, or one per parameter
    "compiled": ("compiled", "triton"),
}


def profiled_ops(fn) -> dict:
    """{kind: sorted operator names} of OP_KINDS seen while fn ran (host-side op records only:
    the op names say which kernels were dispatched, at little cost)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    return {kind: sorted(n for n in names if any(p in n.lower() for p in pats))
            for kind, pats in OP_KINDS.items()}


def _qual(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def nll_loss(out, mb, counts):
    """The engine's loss callback: this micro-batch's share of the batch's token-mean NLL."""
    return -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens, {}


@functools.cache
def compile_problem(device) -> str:
    """'' where torch.compile builds and runs a small SwiGLU-like kernel on `device`, else why not
    (no C compiler, no Python headers, no Triton: common on offline GPU nodes). Cached: the
    benchmark asks once before it times any build."""
    try:
        fn = torch.compile(lambda x: torch.nn.functional.silu(x) * x)
        fn(torch.ones(64, device=device))
        return ""
    except Exception as e:  # whatever inductor raises, the answer is "not here"
        from torch import _dynamo

        _dynamo.reset()  # a failed compile leaves its caches behind
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def liger_stand_in() -> bool:
    """A CPU rehearsal's stand-in for liger-kernel (a package that says so): its kernels are torch ops."""
    try:
        import liger_kernel
    except ImportError:
        return False
    return bool(getattr(liger_kernel, "CPU_STAND_IN", False))


def side_problem(name: str, device=None) -> str:
    """'' where side `name` can be built here, else why not."""
    from verl_hpc.engines.fsdp.liger import liger_choice, liger_installed
    from verl_hpc.runtime.device import has_gpu

    if name == "fsdp_noliger":
        on, why = liger_choice(None, gpu=has_gpu(), installed=liger_installed())
        return "" if on else f"the fsdp column runs without Liger already ({why})"
    if name == "transformers_liger":
        if liger_stand_in():
            return ""
        on, why = liger_choice(None, gpu=has_gpu(), installed=liger_installed())
        return "" if on else why
    if name == "fsdp_compile":
        why = compile_problem(device or ("cuda" if has_gpu() else "cpu"))
        return f"torch.compile cannot build here ({why})" if why else ""
    if not name.startswith("engine"):
        return ""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        return f"megatron-core does not import ({e})"
    return ""


def cpu_budget_chunk(shape) -> int:
    """model.logits_chunk_tokens the CPU's fixed budget gives at this vocabulary (256 MiB of fp32
    logits): the output layer before the device rule (planning/output_layer.py). A rehearsal's tiny
    vocabulary would fit every micro-batch in one chunk: there a quarter of the scored tokens, so
    that its chunks run."""
    from verl_hpc.planning.output_layer import cpu_chunk

    scored = shape.seqs * (shape.seq - shape.prompt)
    chunk = cpu_chunk(shape.vocab)
    return chunk if chunk < scored else max(16, scored // 4 // 16 * 16)


def output_layer(head) -> str:
    """How an engine's output layer scored the last micro-batch (FSDP's ChunkedHead, Megatron's
    ChunkedOutputLayer; None: never chunked)."""
    if head is None:
        return "the whole logits (model.logits_chunk_tokens = 0)"
    last = getattr(head, "last", None)
    how = {None: "the whole logits (the model's own output layer)", "whole": "the whole logits",
           "liger": "Liger's fused linear cross-entropy"}.get(
        last, f"chunks of {last} tokens")
    auto = getattr(head, "setting", -1) is None or getattr(head.chunk, "auto", False)
    ruled = _on_device(head) or getattr(head, "free_read", None) is not None  # a rehearsal pretends a device
    rule = ("auto, the device's free memory" if auto and ruled else
            f"chunks of {int(head.chunk)} tokens above that")
    return f"{how} (last micro-batch; rule: {rule})"


def _on_device(head) -> bool:
    w = getattr(head, "linear", None)
    w = w.weight if w is not None else head.layer.weight
    return w.device.type == "cuda"


def swiglu_kind(mlp) -> str:
    """The MLP's activation: Liger's fused SwiGLU (its class, or its forward bound on the
    instance: `_get_name` says so), else transformers' activation module then a product."""
    name = mlp._get_name() if hasattr(mlp, "_get_name") else type(mlp).__name__
    act = getattr(mlp, "act_fn", None)
    if "Liger" in name or "Liger" in type(mlp).__name__:
        return f"Liger's fused SwiGLU ({name})"
    if act is None:
        return f"{_qual(type(mlp))}'s own forward (no act_fn)"
    return f"unfused ({_qual(type(act))} then a product)"


class EngineSide:
    """MegatronEngine as the actor builds it (default config), one micro-batch of every sequence.
    Where auto would fuse SwiGLU (a GPU) but torch.compile cannot build here, the fusion is turned
    off and `kernels()` says why, rather than the first step failing inside Megatron."""

    CHUNK = None  # model.logits_chunk_tokens: None (auto), 0 (the whole logits) or "cpu" (the CPU's budget)

    def __init__(self, folder, shape, dtype: str, device):
        import dataclasses

        from verl_hpc.engines.megatron import default_options, MegatronEngine
        from verl_hpc.runtime.device import has_gpu

        chunk = cpu_budget_chunk(shape) if self.CHUNK == "cpu" else self.CHUNK
        options = default_options(model_path=str(folder), dtype=dtype, micro_batch_size=shape.seqs,
                                  max_tokens_per_microbatch=0,  # fixed: both sides see one batch
                                  logits_chunk_tokens=chunk)
        self.no_compile = compile_problem(device) if has_gpu() else ""
        if self.no_compile and options.kernels.bias_activation_fusion is None:
            options.kernels = dataclasses.replace(options.kernels, bias_activation_fusion=False)
        self.engine = MegatronEngine(options)

    def train(self, batch) -> float:
        return float(self.engine.train_step(batch, nll_loss)["loss"])

    def forward(self, batch):
        return self.engine.forward(batch, ("log_probs",))["log_probs"]

    def kernels(self) -> dict:
        from verl_hpc.engines.megatron.kernels import kernel_report

        eng = self.engine
        wrapper = getattr(eng.optimizer, "chained_optimizers", [eng.optimizer])[0]
        inner = wrapper.optimizer
        fused_adam = bool(inner.param_groups[0].get("fused")) or "fused" in type(inner).__name__.lower()
        out = kernel_report(eng.gpt_chunks, eng.perf)
        if self.no_compile and not eng.perf.bias_activation_fusion:
            out["swiglu"] += f": torch.compile fails here ({self.no_compile})"
        out["output layer"] = output_layer(getattr(eng, "_chunked", None))
        out["optimizer"] = (f"{_qual(type(wrapper))} over {_qual(type(inner))}"
                            + (" (fused kernel)" if fused_adam else " (per-tensor loop)"))
        return out

    def close(self) -> None:
        self.engine = None
        gc.collect()


class EngineWholeLogitsSide(EngineSide):
    """The Megatron engine with the whole logits always (model.logits_chunk_tokens = 0)."""
    CHUNK = 0


class EngineCpuBudgetSide(EngineSide):
    """The Megatron engine's output layer before the device rule: chunks of the CPU's fixed budget
    (256 MiB of fp32 logits: 2,096 tokens at V = 32,000) for every micro-batch above one chunk."""
    CHUNK = "cpu"


class FsdpSide:
    """FsdpEngine as the actor builds it with parallel.engine=fsdp (default config): the HF model as
    transformers builds it (SDPA attention), fully_shard per decoder layer over a one-rank mesh,
    bf16 compute over fp32 master weights and fp32 gradient reduction on a GPU
    (fsdp.mixed_precision auto = model.dtype), its AdamW over the DTensor shards, clipping;
    one micro-batch of every sequence, as the other sides."""

    CHANGES: dict = {}  # EngineOptions fields a variant replaces (the subclasses below)
    FUSED_ADAM = True

    def __init__(self, folder, shape, dtype: str, device):
        from verl_hpc.engines.fsdp import FsdpEngine
        from verl_hpc.engines.options import default_options

        opts = default_options(model_path=str(folder), engine="fsdp", dtype=dtype,
                               micro_batch_size=shape.seqs, max_tokens_per_microbatch=0)
        changes = dict(self.CHANGES)
        if changes.get("logits_chunk_tokens") == "cpu":
            changes["logits_chunk_tokens"] = cpu_budget_chunk(shape)
        # fields of the fsdp section
        fsdp = {k: changes.pop(k) for k in ("liger", "compile", "reshard_after_forward") if k in changes}
        if fsdp:
            changes["fsdp"] = dataclasses.replace(opts.fsdp, **fsdp)
        self.engine = FsdpEngine(dataclasses.replace(opts, **changes))
        if not self.FUSED_ADAM:  # torch's default AdamW (foreach), the engine's before issue 68
            import verl_hpc.engines.fsdp.optim as optim_lib

            eng = self.engine
            eng.optimizer = optim_lib.build_optimizer(eng.model, eng.options.optim, fused=False)
            eng.scheduler = optim_lib.LRSchedule(eng.optimizer, eng.options.optim, eng.options.total_steps)

    def train(self, batch) -> float:
        return float(self.engine.train_step(batch, nll_loss)["loss"])

    def forward(self, batch):
        return self.engine.forward(batch, ("log_probs",))["log_probs"]

    def kernels(self) -> dict:
        eng = self.engine
        model = eng.model
        layer = model.model.layers[0]
        group = eng.optimizer.param_groups[0]
        impl = ("fused" if group.get("fused") else "foreach" if group.get("foreach")
                else "torch's default: foreach on CUDA, a per-tensor loop on CPU")
        head = eng._head
        norm = layer.input_layernorm
        return {
            "attention": f"{model.config._attn_implementation} (transformers' attention interface)",
            "norm": f"{_qual(type(norm))} ({norm._get_name()})",
            "swiglu": swiglu_kind(layer.mlp),
            "output layer": output_layer(head) + (", log-probs alone by Liger's fused linear cross-entropy"
                                                  if head is not None and head.liger else ""),
            "precision": f"fp32 master weights, {str(eng.compute_dtype).replace('torch.', '')} compute "
                         "(FSDP2 MixedPrecisionPolicy), fp32 gradient reduction",
            "sharding": f"fully_shard per {type(layer).__name__} + root, mesh {tuple(eng.mesh.shape)}, "
                        f"reshard_after_forward={eng.options.fsdp.reshard_after_forward}, "
                        f"compile={eng.options.fsdp.compile}",
            "optimizer": f"{_qual(type(eng.optimizer))} over DTensor shards ({impl})",
        }

    def close(self) -> None:
        self.engine = None
        gc.collect()


class FsdpWholeLogitsSide(FsdpSide):
    """The FSDP engine's output layer before the chunked one: the whole logits
    (model.logits_chunk_tokens = 0), no Liger; fused AdamW as the fsdp column."""
    CHANGES = {"logits_chunk_tokens": 0, "liger": False}


class FsdpCpuBudgetSide(FsdpSide):
    """The FSDP engine's output layer before the device rule: chunks of the CPU's fixed budget
    (256 MiB of fp32 logits) for every micro-batch above one chunk; Liger as the fsdp column."""
    CHANGES = {"logits_chunk_tokens": "cpu"}


class FsdpCompileSide(FsdpSide):
    """The fsdp column with per-block torch.compile (fsdp.compile = true): each decoder layer
    compiled after sharding. Its build includes the compilation's first part; the warm-up
    iterations the rest (not timed). Its recompilations are logged (torch's `recompiles` log, with
    the reason) and counted in `kernels()`."""
    CHANGES = {"compile": True}

    def __init__(self, *args):
        from torch._dynamo.utils import counters

        self._before = _compile_counts(counters)
        torch._logging.set_logs(recompiles=True)
        super().__init__(*args)

    def kernels(self) -> dict:
        from torch._dynamo.utils import counters

        now = _compile_counts(counters)
        out = super().kernels()
        out["compile"] = (f"{now[0] - self._before[0]} graphs from {now[1] - self._before[1]} frames compiled "
                          "over the side's life (recompiles with their reasons: the log)")
        return out

    def close(self) -> None:
        torch._logging.set_logs()  # torch's defaults again
        super().close()


def _compile_counts(counters) -> tuple:
    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


class FsdpKeepGatheredSide(FsdpSide):
    """The fsdp column with fsdp.reshard_after_forward = false: each layer's gathered weights kept
    from its forward to its backward (at one rank the gather is a copy and a cast, done twice a
    step with resharding on)."""
    CHANGES = {"reshard_after_forward": False}


class FsdpLoopClipSide(FsdpSide):
    """The fsdp column with the per-parameter gradient norm and clip (engines/fsdp/optim.py
    FOREACH = False: a DTensor op and a kernel per parameter), against the foreach forms the fsdp
    column runs. The switch is put back at close()."""

    def __init__(self, *args):
        import verl_hpc.engines.fsdp.optim as optim_lib

        super().__init__(*args)
        self._foreach, optim_lib.FOREACH = optim_lib.FOREACH, False

    def close(self) -> None:
        import verl_hpc.engines.fsdp.optim as optim_lib

        optim_lib.FOREACH = self._foreach
        super().close()


class FsdpForeachAdamSide(FsdpSide):
    """The fsdp column with torch's default AdamW (foreach) instead of the fused one."""
    FUSED_ADAM = False


class FsdpNoLigerSide(FsdpSide):
    """The fsdp column without Liger (fsdp.liger = false): the chunked PyTorch output layer and
    transformers' own norm and MLP. Only where Liger is on in the fsdp column."""
    CHANGES = {"liger": False}
