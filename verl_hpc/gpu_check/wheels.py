"""Prepare the wheel folder `python -m verl_hpc.gpu_check` needs on a GPU machine without network.

    python -m verl_hpc.gpu_check.wheels OUT [--python-version 3.11] [--glibc 2.28]

The GPU machine brings CUDA torch (and what torch itself depends on); this folder carries the rest:
megatron-core and the packages the checks import (transformers and its tokenizer/hub stack,
omegaconf, h5py, ...), as wheels for the target's Python and platform, resolved here by pip
(`pip install --dry-run --report`, then `pip download --no-deps` of exactly the resolved versions;
pip does the resolving and the downloading, this module only picks and measures). The folder must
stay under 64 MiB (what travels with the work tree to the GPU machine); the script fails otherwise.
On the GPU machine:  pip install --no-index --find-links OUT -r OUT/requirements.txt
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List

LIMIT_BYTES = 64 * 2**20
# Exact versions this project's tests run with (the CPU venv): the GPU check compares against the
# same transformers the CPU parity tests use.
def requirements() -> List[str]:
    from verl_hpc.parallel.cpu_compat import VERIFIED_MEGATRON_VERSION

    return [f"megatron-core=={VERIFIED_MEGATRON_VERSION}", f"transformers=={version('transformers')}",
            f"tokenizers=={version('tokenizers')}", f"safetensors=={version('safetensors')}",
            f"omegaconf=={version('omegaconf')}", f"h5py=={version('h5py')}", "isal", "tqdm", "rich",
            "packaging"]


# Present wherever CUDA torch is installed (torch's own dependencies), so not carried. numpy is
# carried: torch does not require it (h5py and transformers do).
WITH_TORCH = {"torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec",
              "filelock", "typing-extensions", "setuptools", "cuda-bindings",
              "cuda-pathfinder", "cuda-toolkit"}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def carried(name: str) -> bool:
    n = _canonical(name)
    return n not in WITH_TORCH and not n.startswith("nvidia-")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def target_args(python_version: str, glibc: str) -> List[str]:
    """pip's options for the target interpreter; every manylinux tag a glibc `glibc` system runs
    (pip takes the tags literally, it does not expand them)."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return ["--python-version", python_version, "--only-binary=:all:",
            *[a for t in tags for a in ("--platform", t)]]


def resolve(reqs: List[str], python_version: str, glibc: str) -> Dict[str, str]:
    """{name: version} of everything pip would install for `reqs` on the target."""
    target = target_args(python_version, glibc)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
             "--target", str(Path(tmp) / "t"), *target, *reqs)
        data = json.loads(report.read_text())
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in data["install"]}


def prepare(out: Path, python_version: str, glibc: str) -> Dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    pins = {n: v for n, v in resolve(requirements(), python_version, glibc).items() if carried(n)}
    target = target_args(python_version, glibc)
    _pip("download", "--no-deps", "--quiet", "--dest", str(out), *target,
         *[f"{n}=={v}" for n, v in sorted(pins.items())])
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    return {w.name: w.stat().st_size for w in sorted(out.glob("*.whl"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    ap.add_argument("--glibc", default="2.28", help="the GPU machine's glibc (x86_64 Linux)")
    args = ap.parse_args(argv)
    sizes = prepare(args.out, args.python_version, args.glibc)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    for name, size in sizes.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{total / 2**20:8.2f} MiB  total in {args.out} ({len(sizes)} wheels; limit 64 MiB)")
    if total >= LIMIT_BYTES:
        print(f"too large: {total / 2**20:.2f} MiB >= 64 MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
