"""Does the installed vLLM kit import what an engine needs? Run by the install step (vllm_pieces.py)
on the GPU node and by `make gpu-vllm-kit-check` on a CPU machine, in the interpreter that has the
kit; of the project's it imports only runtime.device (whether there is a GPU) and, to build an
engine, the environment every engine of the project's is built with (rollout/vllm/environment.py).

    python -m verl_hpc.gpu_check.vllm_kit_probe [--model DIR]

Imports `vllm` and `from vllm import LLM`, then ENGINE_MODULES: what building an engine on a GPU
imports (the GPU worker and model runner, FlashAttention's backend, the Llama model, structured
output, the n-gram proposer, the sleep allocator, the LoRA and speculative paths this project uses).
With --model it builds `LLM(DIR)`: on a GPU that must succeed; without one it must fail for want of
the device and not for a missing module. One line per finding; exit 1 on a missing module, or a
failure that is not the missing device.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Tuple

ENGINE_MODULES = (
    "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.fa_utils", "vllm.vllm_flash_attn.flash_attn_interface",
    "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2", "vllm.model_executor.model_loader",
    "vllm.v1.structured_output", "vllm.v1.spec_decode.ngram_proposer", "vllm.v1.spec_decode.eagle",
    "vllm.device_allocator.cumem", "vllm.v1.sample.sampler", "vllm.lora.request", "vllm.lora.worker_manager",
    "vllm.compilation.backends", "vllm.distributed.device_communicators.cuda_communicator",
    "vllm.distributed.parallel_state",
)
# What only a machine with an NVIDIA driver loads: without one these are the missing device, not a
# missing module (the sleep allocator links libcuda.so.1; vLLM's platform is then "unspecified")
NO_DEVICE = ("libcuda.so", "Device string must not be empty", "No CUDA GPUs", "Found no NVIDIA driver",
             "NVIDIA driver", "CUDA driver")


def needs_device(text: str) -> bool:
    return any(s in text for s in NO_DEVICE)


def probe_imports(modules=ENGINE_MODULES) -> Tuple[List[str], List[str]]:
    """(problems, notes): a module that cannot be found is a problem; one that needs the device
    where there is none is a note."""
    problems, notes = [], []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            problems.append(f"{name}: missing module {e.name}")
        except Exception as e:  # noqa: BLE001 (an extension that needs the driver raises ImportError or OSError)
            line = f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            (notes if needs_device(str(e)) else problems).append(line)
    return problems, notes


def build(model: str) -> Tuple[List[str], str]:
    """([problem] or [], what happened) of LLM(model) in this process."""
    from verl_hpc.rollout.vllm import environment as vllm_environment

    vllm_environment.apply()  # as every engine of the project's: in-process, no FlashInfer sampler without it
    from vllm import LLM

    from verl_hpc.runtime.device import has_gpu

    try:
        llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.2,
                  max_model_len=256)
    except ModuleNotFoundError as e:
        return [f"LLM({model}): missing module {e.name}"], ""
    except Exception as e:  # noqa: BLE001 (the engine's own error, classified below)
        text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if needs_device(str(e)) and not has_gpu():
            return [], f"LLM(...) stops for want of a GPU, as it must here: {text}"
        return [f"LLM({model}): {text}"], ""
    out = llm.generate(["Hello"], use_tqdm=False)
    return [], f"LLM(...) built and generated {len(out[0].outputs[0].token_ids)} tokens"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_hpc.gpu_check.vllm_kit_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model folder: also build LLM(model)")
    args = ap.parse_args(argv)
    try:
        import vllm
        from vllm import LLM  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"vllm kit: `from vllm import LLM` fails: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}")
    problems, notes = probe_imports()
    from verl_hpc.runtime.device import has_gpu

    if has_gpu():  # with a GPU here, "needs the driver" is a failure of the driver
        problems, notes = problems + notes, []
    print(f"{len(ENGINE_MODULES) - len(problems) - len(notes)} of {len(ENGINE_MODULES)} engine modules import"
          + "".join(f"\n  needs the GPU's driver here: {n}" for n in notes))
    if args.model:
        more, what = build(args.model)
        problems += more
        if what:
            print(what)
    for p in problems:
        print(f"vllm kit: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
