"""Build the vLLM kit for an offline GPU node: a slim vLLM for Hopper (sm_90) and the wheels its
import needs beside the node's image and the kit's wheel folder, in pieces that each travel with
the work tree in one 64 MiB transfer.

    python -m verl_hpc.gpu_check.vllm_kit OUT [--python-version 3.12] [--piece-mib 48] [--image LIST]
    make gpu-vllm-kit                      # OUT = gpu_vllm_kit (ignored by git)

The node (docs/gpu.md): Python 3.12, CUDA torch 2.11.0+cu130 with triton and numba, no network;
the kit's wheel folder (wheels.py) brings transformers and the rest of the checks' packages. vLLM
VLLM_VERSION is the release whose wheel requires torch 2.11.0 and links libcudart.so.13, as that
image's torch does. What this module does, each step by pip or the standard library:
1. `pip download --no-deps vllm==VLLM_VERSION` for the target (cp38-abi3, manylinux x86_64).
2. Reads that wheel's Requires-Dist and keeps the requirements of IMPORT_NEEDS, the distributions
   that `from vllm import LLM` and an engine's construction import (the rest of vLLM's list is
   imported lazily by features a dense bf16 model does not use: flashinfer, the structured-output
   backends, compressed-tensors, depyf, the serving stack's extras, the CUDA-13 kernel libraries).
   pip resolves them with the kit folder's requirements for the target Python
   (`pip install --dry-run --report`, wheels.resolve), and the kit carries the resolved wheels that
   neither torch's install (wheels.WITH_TORCH) nor the kit folder brings, typing-extensions
   included (pydantic needs a newer one than torch's).
3. Slims vLLM's wheel (SLIM_DROP: what is dropped and why it is safe on sm_90 for a dense model),
   rewrites its RECORD without the dropped files, and stores every wheel uncompressed (zip stored)
   so that xz, not deflate, compresses the bytes.
4. Packs the wheels and requirements.txt (the exact pins) into one tar.xz (preset 9), cuts it into
   pieces of --piece-mib (<= 60 MiB) with MANIFEST.json (vllm_pieces.py: sha256 of each piece and
   of the archive), and checks that each transfer (the work tree as git would copy it, the
   manifest and one piece) stays under 64 MiB.
With `--image LIST` (the node's packages, image.py; the kit folder built with the same list) step 2
carries only what neither the image nor the kit folder serves, and the manifest records the image
packages the kit relies on. OUT is new, empty, or this command's last kit (outdir.py): anything
else there is refused before any download and never deleted.
On the node: vllm_pieces.py (stash / verify / install), or `make gpu-all ... VLLM_KIT=DIR`.
"""
from __future__ import annotations

import argparse
import copy
import fnmatch
import io
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from verl_hpc.gpu_check import outdir, vllm_pieces, wheels
from verl_hpc.gpu_check.image import read_list
from verl_hpc.gpu_check.vllm_pieces import KitError

VLLM_VERSION = "0.25.0"  # requires torch==2.11.0 and links libcudart.so.13: the GPU node's image
GLIBC = "2.31"  # llguidance 1.7's wheels (vLLM requires 1.7.x) are manylinux_2_31; vllm_pieces checks the node's
TRANSFER_LIMIT = 64 * 2**20  # what one transfer carries, the work tree included

# The distributions `from vllm import LLM` and building an engine import at module level (found by
# importing the installed slim vLLM in a clean venv beside torch 2.11 and the kit folder, adding
# what the import named, until `LLM(...)` failed only for want of a GPU: `make gpu-vllm-kit-check`
# repeats it). Their version bounds are vLLM's own (its Requires-Dist).
IMPORT_NEEDS = ("cachetools", "cbor2", "psutil", "pyzmq", "requests", "aiohttp", "openai", "openai-harmony",
                "msgspec", "pillow", "pybase64", "py-cpuinfo", "prometheus-client", "llguidance", "xgrammar",
                "fastapi", "starlette", "partial-json-parser", "einops", "pydantic")
# imported at module level by vLLM (v1/utils.py) but required only through fastapi[standard]
INDIRECT_NEEDS = ("uvloop",)
# Beside the resolution: pydantic-core needs typing-extensions >= 4.14 and the image's torch may
# bring an older one (torch's own requirement is only >= 4.10)
ALWAYS_CARRIED = ("typing-extensions",)

# What the slim vLLM leaves out, glob patterns over the wheel's paths, each with why a dense model
# in bf16/fp16 on sm_90 never loads it (every import named here is guarded by vLLM itself).
SLIM_DROP: Tuple[Tuple[str, str], ...] = (
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
     "FlashAttention 2: on sm_90 vLLM picks FlashAttention 3 (v1/attention/backends/fa_utils.py "
     "get_flash_attn_version: Hopper prefers FA3); FA2 serves only ALiBi models, VLLM_BATCH_INVARIANT "
     "and other GPUs; its import is guarded (flash_attn_interface.FA2_AVAILABLE)"),
    ("vllm/vllm_flash_attn/cute/*",
     "FlashAttention 4, CuTe DSL kernels that need cutlass-dsl and quack, which the kit does not carry: "
     "flash_attn_interface.py counts FA4 available when cute/interface.py exists (it imports nothing), and "
     "then FlashAttention's backend claims head sizes 257-512 on sm_90 (supports_head_size) and fails at "
     "the first forward. Without the folder FA4_AVAILABLE is False, nothing imports it at start-up, and a "
     "head size over 256 passes FlashAttention and FlashInfer (not carried) in platforms/cuda.py's order "
     "and gets Triton attention (triton_attn.py: head_size >= 32)"),
    ("vllm/_moe_C_stable_libtorch.abi3.so",
     "mixture-of-experts kernels (routing top-k, block alignment, Marlin MoE): a dense model calls "
     "none; platforms/cuda.py imports it under contextlib.suppress(ImportError)"),
    ("vllm/vllm-rs", "the Rust HTTP frontend binary of `vllm serve`: the in-process engine never "
                     "starts it"),
    ("vllm/_flashmla_C.abi3.so", "FlashMLA, multi-head latent attention (DeepSeek); import guarded "
                                 "(v1/attention/ops/flashmla.py)"),
    ("vllm/_flashmla_extension_C.abi3.so", "FlashMLA's FP8 metadata kernels; import guarded, as above"),
    ("vllm/third_party/flashmla/*", "FlashMLA's Python interface, imported only by the MLA backend"),
    ("vllm/_qutlass_C.abi3.so", "FP4 (MXFP4/NVFP4) GEMMs for Blackwell; imported under "
                                "contextlib.suppress(ImportError)"),
    ("vllm/third_party/deep_gemm/*", "DeepGEMM (JIT headers and one extension per Python): "
                                     "block-scaled FP8 GEMMs, loaded only for FP8 models (utils/deep_gemm.py "
                                     "falls back to None)"),
    ("vllm/third_party/fmha_sm100/*", "Blackwell (sm_100) sparse attention headers of one model family"),
)


def dropped(path: str) -> str:
    """Why `path` of vLLM's wheel is left out of the slim one ('' = kept)."""
    return next((why for pattern, why in SLIM_DROP if fnmatch.fnmatchcase(path, pattern)), "")


def drop_summary(wheel: Path) -> Dict[str, Dict]:
    """{pattern: files, bytes (unpacked), why} of what the slim wheel leaves out (the manifest's)."""
    out = {pattern: {"files": 0, "bytes": 0, "why": why} for pattern, why in SLIM_DROP}
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            pattern = next((p for p, _ in SLIM_DROP if fnmatch.fnmatchcase(info.filename, p)), None)
            if pattern is not None:
                out[pattern]["files"] += 1
                out[pattern]["bytes"] += info.file_size
    return out


def _record_without(text: str, gone: set) -> str:
    """The wheel's RECORD minus the lines of removed files (the others' hashes are unchanged)."""
    return "".join(line for line in io.StringIO(text) if line.split(",", 1)[0] not in gone)


def restore(src: Path, dest: Path, drop=lambda path: "") -> List[str]:
    """Copy the wheel `src` to `dest` stored (uncompressed), leaving out the members `drop` names
    (and their RECORD lines). Returns the members left out."""
    with zipfile.ZipFile(src) as zin:
        gone = [i.filename for i in zin.infolist() if drop(i.filename)]
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                if info.filename in gone:
                    continue
                if info.filename.endswith(".dist-info/RECORD"):
                    zout.writestr(info.filename, _record_without(zin.read(info).decode(), set(gone)),
                                  compress_type=zipfile.ZIP_STORED)
                    continue
                stored = copy.copy(info)  # zin still reads `info` as it is compressed
                stored.compress_type = zipfile.ZIP_STORED
                with zin.open(info) as f, zout.open(stored, "w") as g:
                    shutil.copyfileobj(f, g, 2**22)
    return gone


def requires(wheel: Path) -> Dict[str, str]:
    """{canonical name: requirement} of the wheel's unconditional Requires-Dist (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    out = {}
    for req in msg.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[<>=!~\[; (]", req, maxsplit=1)[0]
        out[wheels._canonical(name)] = req
    return out


def import_requirements(wheel: Path) -> List[str]:
    """IMPORT_NEEDS with vLLM's bounds, without extras (fastapi[standard] would add the CLI, the
    server and their dependencies, which the import does not need), and INDIRECT_NEEDS."""
    from packaging.requirements import Requirement

    reqs = requires(wheel)
    missing = [n for n in IMPORT_NEEDS if n not in reqs]
    if missing:  # a new vLLM dropped one: the list must be found again (make gpu-vllm-kit-check)
        raise SystemExit(f"{wheel.name} does not require {', '.join(missing)}: IMPORT_NEEDS is for vllm {VLLM_VERSION}")
    out = []
    for n in IMPORT_NEEDS:
        req = Requirement(reqs[n])
        req.extras = set()
        out.append(str(req))
    return out + list(INDIRECT_NEEDS)


def carried_pins(joint: Dict[str, str], base: Dict[str, str], served: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """What the vLLM kit carries of the joint resolution, all but what the kit folder (`base`)
    brings at the same version and: without the image's list, torch's install (typing-extensions
    always carried); with it (`served`: what the image serves of the joint resolution), the image's."""
    out = {}
    for name, ver in joint.items():
        n = wheels._canonical(name)
        if served is None:
            keep = n in ALWAYS_CARRIED or (wheels.carried(n) and base.get(n) != ver)
        else:
            keep = n not in served and base.get(n) != ver
        if keep:
            out[n] = ver
    return out


def tree_bytes(root: Path) -> int:
    """The work tree as the transfer copies it: tracked and untracked, not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def pack(files: List[Path], archive: Path) -> None:
    with lzma.open(archive, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for f in files:
            tar.add(f, arcname=f.name)


def owned(out: Path) -> List[str]:
    """What this command's last run wrote in `out`: MANIFEST.json and the pieces it lists ([] without one)."""
    if not (out / vllm_pieces.MANIFEST).exists():
        return []
    try:
        manifest = vllm_pieces.read_manifest(out)
    except KitError as e:
        raise KitError(f"{e}: so {out} is not a kit this command built; name a new folder")
    return [vllm_pieces.MANIFEST] + [p["name"] for p in manifest["pieces"]]


def build(out: Path, python_version: str, glibc: str, piece_mib: float, cache: Path,
          image: Optional[Dict[str, str]] = None) -> Dict:
    """The kit, made in OUT's partial folder and published over the last build's files (outdir.py):
    a folder holding anything else is refused before any download."""
    old = owned(out)
    outdir.refuse_foreign(out, old, "a kit this command built (MANIFEST.json and the pieces it lists)")
    work = outdir.partial(out)
    try:
        manifest = _build(work, python_version, glibc, piece_mib, cache, image)
    except BaseException:
        outdir.discard(out)  # OUT as it was: the last build's files, nothing half-written
        raise
    outdir.publish(out, old, [vllm_pieces.MANIFEST] + [p["name"] for p in manifest["pieces"]], vllm_pieces.MANIFEST)
    return manifest


def _build(work: Path, python_version: str, glibc: str, piece_mib: float, cache: Path,
           image: Optional[Dict[str, str]]) -> Dict:
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KitError(f"--cache {cache}: cannot write there ({e.strerror}); valid: a folder this user may write")
    target = wheels.target_args(python_version, glibc)
    dl = cache / f"py{python_version}"
    wheels._pip("download", "--no-deps", "--quiet", "--dest", str(dl), *target, f"vllm=={VLLM_VERSION}")
    full = _find_wheel(dl, "vllm", VLLM_VERSION)
    base, base_served = wheels.resolve_against(wheels.requirements(), python_version, glibc, dl, image)
    joint, served = wheels.resolve_against(wheels.requirements() + import_requirements(full), python_version,
                                           glibc, dl, image)
    if image:  # the kit folder, built with the same list, carries what the image does not serve
        base = wheels.carried_pins(base, base_served)
    pins = carried_pins(joint, base, served if image else None)
    wheels._pip("download", "--no-deps", "--quiet", "--dest", str(dl), *target,
                *[f"{n}=={v}" for n, v in sorted(pins.items())])
    stage = cache / f"stage{python_version}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    restore(full, stage / full.name, dropped)
    for n, v in sorted(pins.items()):
        w = _find_wheel(dl, n, v)
        restore(w, stage / w.name)
    reqs = stage / "requirements.txt"
    reqs.write_text(f"vllm=={VLLM_VERSION}\n" + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    files = sorted(stage.glob("*.whl")) + [reqs]
    archive = cache / vllm_pieces.ARCHIVE
    print(f"packing {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB stored, "
          "with xz (preset 9) ...", flush=True)
    try:
        pack(files, archive)
        pieces = vllm_pieces.split(archive, work, int(piece_mib * 2**20))
        # `image`: the image's packages the kit relies on (install checks the node has them)
        return vllm_pieces.write_manifest(
            work, archive, pieces, vllm=VLLM_VERSION, python=python_version, glibc=glibc,
            requirements=reqs.read_text().split(),
            wheels={f.name: f.stat().st_size for f in files if f.suffix == ".whl"},
            dropped=drop_summary(full), **({"image": served} if image else {}))
    finally:
        archive.unlink(missing_ok=True)


def _find_wheel(folder: Path, name: str, ver: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for w in folder.glob("*.whl"):
        parts = w.name.split("-")
        if re.sub(r"[-_.]+", "_", parts[0]).lower() == stem and parts[1] == ver:
            return w
    raise SystemExit(f"{name}=={ver}: pip downloaded no wheel into {folder}")


def transfers(manifest: Dict, tree: int) -> List[Tuple[str, int]]:
    """(piece, bytes of its transfer: the tree, the manifest and the piece) per transfer."""
    extra = tree + len(json.dumps(manifest, indent=1)) + 1
    return [(p["name"], extra + p["bytes"]) for p in manifest["pieces"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_hpc.gpu_check.vllm_kit", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--python-version", default="3.12", help="the GPU node's Python, X.Y (default 3.12)")
    ap.add_argument("--glibc", default=GLIBC, help=f"the GPU node's glibc (default {GLIBC}: llguidance 1.7, "
                                                     "which vLLM needs, has no wheel for an older one)")
    ap.add_argument("--piece-mib", type=float, default=48.0,
                    help="largest piece, MiB (default 48: with a ~7 MB tree a transfer stays far under 64)")
    ap.add_argument("--image", type=Path, help="the GPU node's package list (python -m verl_hpc.gpu_check.image list "
                                              "there; the kit folder built with the same): carry only what "
                                              "neither it nor the kit folder brings")
    ap.add_argument("--cache", type=Path, default=Path("build/vllm_kit_cache"),
                    help="downloads and the staging folder (default build/vllm_kit_cache)")
    args = ap.parse_args(argv)
    for option, value in (("--python-version", args.python_version), ("--glibc", args.glibc)):
        if not re.fullmatch(r"\d+\.\d+", value):
            ap.error(f"{option}: got {value!r}; valid: X.Y, e.g. 3.12 (Python) or 2.28 (glibc)")
    if not 0 < args.piece_mib <= vllm_pieces.PIECE_LIMIT / 2**20:
        ap.error(f"--piece-mib {args.piece_mib:g}; valid: more than 0, at most {vllm_pieces.PIECE_LIMIT // 2**20}")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"OUT '{args.out}' is a file; valid: a folder (new, or one this command wrote)")
    try:
        image = read_list(args.image) if args.image else None
        manifest = build(args.out, args.python_version, args.glibc, args.piece_mib, args.cache, image)
    except KitError as e:
        print(f"vllm_kit: {e}", file=sys.stderr)
        return 1
    root = Path(__file__).resolve().parents[2]
    tree = tree_bytes(root)
    print(f"vllm {VLLM_VERSION} slim for sm_90, Python {args.python_version}: "
          f"{len(manifest['wheels'])} wheels, archive {manifest['archive']['bytes'] / 2**20:.1f} MiB")
    worst = 0
    for name, size in transfers(manifest, tree):
        worst = max(worst, size)
        print(f"  transfer: {name} + MANIFEST.json + the work tree ({tree / 2**20:.1f} MiB) = {size / 2**20:.1f} MiB")
    if worst >= TRANSFER_LIMIT:
        print(f"a transfer would be {worst / 2**20:.1f} MiB >= 64 MiB: use a smaller --piece-mib", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
