"""Prepare the wheel folder `python -m verl_hpc.gpu_check` needs on a GPU machine without network.

    python -m verl_hpc.gpu_check.wheels OUT [--python-version 3.12 | --target-python PATH] [--glibc 2.28]
                                            [--image LIST]

The GPU machine brings CUDA torch (and what torch itself depends on); this folder carries the rest:
megatron-core and the packages the checks import (transformers and its tokenizer/hub stack,
omegaconf, h5py, ...), as wheels for the target's Python and platform, resolved here by pip
(`pip install --dry-run --report`, then `pip download --no-deps` of exactly the resolved versions;
pip does the resolving and the downloading, this module only picks and measures).

The target's Python: `--python-version`, or `--target-python PATH` (that interpreter is asked for
its version and glibc), default the running interpreter. A package that exists only as a source
distribution (omegaconf 2.3 needs antlr4-python3-runtime, which has no wheel) is built into a wheel
here with `pip wheel` when it is pure Python; the GPU machine then installs wheels only and builds
nothing. The folder must stay under 64 MiB (what travels with the work tree to the GPU machine);
the script fails otherwise.
With `--image LIST` (the node's packages, image.py) the folder carries only what the image does not
serve (image.served, then pip resolves again holding the image's versions), instead of all but
torch's install. OUT is new, empty, or this command's last build (FILES names what it wrote):
a folder holding anything else is refused before any download, and nothing of it is deleted.
On the GPU machine (gpu-all does it in the kits' prefix over the image, image.py):
    pip install --no-index --find-links OUT -r OUT/requirements.txt
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from verl_hpc.gpu_check import outdir
from verl_hpc.gpu_check.image import constraint, read_list, required_by, served
from verl_hpc.gpu_check.vllm_pieces import KitError

LIMIT_BYTES = 64 * 2**20
MAX_SOURCE_BUILDS = 5  # sdist-only packages built into wheels before giving up
MAX_IMAGE_ROUNDS = 10  # resolutions against the image's versions before taking the last that held


# Exact versions this project's tests run with (the CPU venv): the GPU check compares against the
# same transformers the CPU parity tests use.
def requirements() -> List[str]:
    from verl_hpc.parallel.cpu_compat import VERIFIED_MEGATRON_VERSION

    return [f"megatron-core=={VERIFIED_MEGATRON_VERSION}", f"transformers=={version('transformers')}",
            f"tokenizers=={version('tokenizers')}", f"safetensors=={version('safetensors')}",
            f"omegaconf=={version('omegaconf')}", f"h5py=={version('h5py')}", "isal", "tqdm", "rich",
            "packaging", "pytest", "pytest-timeout",  # pytest: `make gpu-all` runs the gpu-marked tests
            f"submitit=={version('submitit')}",  # the demo's launcher; the GPU image lacks it (a 75 kB wheel)
            LIGER_REQUIREMENT]  # the FSDP engine's fused kernels (fsdp.liger auto) and the benchmark's peer


# Liger-Kernel for the GPU: pure Python with Triton kernels (Triton comes with CUDA torch); the
# version the issue-75 GPU run used
LIGER_REQUIREMENT = "liger-kernel==0.8.5"


def project_requirements() -> List[str]:
    """setup.py's install_requires (CORE): what a job and the demo import besides the checks'
    packages (pyarrow, submitit, matplotlib, ...). Read from setup.py, the one place they are
    written; the folder made with them is larger than the 64 MiB carry."""
    import ast

    tree = ast.parse((Path(__file__).resolve().parents[2] / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CORE":
            return list(ast.literal_eval(node.value))
    raise SystemExit("setup.py has no CORE list")


def merged(reqs: List[str], extra: List[str]) -> List[str]:
    """reqs plus the extra requirements whose package reqs does not name already."""
    named = {_name_of(r) for r in reqs}
    return reqs + [r for r in extra if _name_of(r) not in named]


# Present wherever CUDA torch is installed (torch's own dependencies), so not carried. numpy is
# carried: torch does not require it (h5py and transformers do).
WITH_TORCH = {"torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec",
              "filelock", "typing-extensions", "setuptools", "cuda-bindings",
              "cuda-pathfinder", "cuda-toolkit"}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _name_of(requirement: str) -> str:
    """The canonical package name of a requirement ('Foo_Bar[x]>=1' -> 'foo-bar')."""
    return _canonical(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])


def carried(name: str) -> bool:
    n = _canonical(name)
    return n not in WITH_TORCH and not n.startswith("nvidia-")


def _pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    """pip with this interpreter; unless `capture` (the caller reads the outcome), a failure is one
    line (SystemExit): what pip was asked, whether the index was reachable, pip's last error."""
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if r.returncode != 0 and not capture:
        raise SystemExit(pip_failed(args, r.stderr))
    return r


# pip's words when it cannot reach an index (its retries are WARNINGs, which --quiet still shows)
_UNREACHABLE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                          r"Name or service not known|Network is unreachable|Connection refused|ConnectTimeout|"
                          r"ReadTimeout|ProxyError|SSLError|Could not fetch URL")


# the pip options this module passes that take a value (the rest of a command's words are packages)
_VALUED = {"--dest", "--python-version", "--platform", "--find-links", "--report", "--target", "-c", "--wheel-dir"}


def pip_failed(args, stderr: str) -> str:
    """One line for a failed pip command: its subcommand and packages, whether the package index was
    unreachable, and pip's last error line."""
    pkgs = [a for prev, a in zip(args, args[1:]) if not a.startswith("-") and prev not in _VALUED]
    named = ", ".join(pkgs[:3]) + (f" and {len(pkgs) - 3} more" if len(pkgs) > 3 else "")
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "(no output)")
    why = "the package index was unreachable" if _UNREACHABLE.search(stderr) else "pip failed"
    return f"pip {args[0]} {named or '(no package)'}: {why}: {last[:300]}"


PROBE = ("import platform, sys; print('%d.%d' % sys.version_info[:2]); "
         "lib, ver = platform.libc_ver(); print(ver if lib == 'glibc' else '')")


def probe_target(python: str) -> Tuple[str, Optional[str]]:
    """(Python version 'X.Y', glibc 'X.Y' or None) of the interpreter at `python`."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"--target-python {python}: could not run it ({e})")
    lines = out.split("\n")
    return lines[0].strip(), (lines[1].strip() or None) if len(lines) > 1 else None


def target_args(python_version: str, glibc: str) -> List[str]:
    """pip's options for the target interpreter; every manylinux tag a glibc `glibc` system runs
    (pip takes the tags literally, it does not expand them)."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return ["--python-version", python_version, "--only-binary=:all:",
            *[a for t in tags for a in ("--platform", t)]]


_OTHER_PYTHON = re.compile(r"Package '([^']+)' requires a different Python")
# pip's words when a requirement has no wheel for the target (with --only-binary=:all:)
_NO_WHEEL = re.compile(r"Could not find a version that satisfies the requirement (\S+)")


def missing_wheel(stderr: str) -> Optional[str]:
    """The requirement pip found no wheel for (e.g. 'antlr4-python3-runtime==4.9.*'), or None."""
    m = _NO_WHEEL.search(stderr)
    return m.group(1) if m else None


def build_pure_wheel(req: str, dest: Path) -> Path:
    """`pip wheel` a source-only requirement into `dest`; only a pure-Python result (py3-none-any)
    is acceptable, since it is built here for another machine."""
    before = set(dest.glob("*.whl"))
    _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(dest), req)
    new = sorted(set(dest.glob("*.whl")) - before)
    if not new:
        raise SystemExit(f"pip wheel {req}: no wheel produced")
    for w in new:
        if not w.name.endswith("-none-any.whl"):
            w.unlink()
            raise SystemExit(f"{req} has no wheel for the target and is not pure Python ({w.name}); "
                             "it cannot be carried: install it on the GPU machine from its index")
    return new[0]


def resolve(reqs: List[str], python_version: str, glibc: str, local: Path) -> Dict[str, str]:
    """{name: version} of everything pip would install for `reqs` on the target."""
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in resolve_items(reqs, python_version, glibc, local)[0]}


def conflict_names(stderr: str, constrained: Sequence[str]) -> List[str]:
    """The constrained packages named in pip's "The conflict is caused by:" lines."""
    block = stderr.split("The conflict is caused by:", 1)[-1].split("To fix this", 1)[0] if "The conflict is" in stderr else ""
    named = set()
    for line in block.splitlines():
        m = re.match(r"\s*(?:The user requested \(constraint\) )?([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if m:
            named.add(_canonical(m.group(1)))
    return sorted(named & {_name_of(c) for c in constrained})


def resolve_items(reqs: List[str], python_version: str, glibc: str, local: Path,
                  constraints: Sequence[str] = ()) -> Tuple[List[Dict], List[str]]:
    """(pip's report entries of everything it would install for `reqs` on the target, []); or,
    where the `constraints` (the image's versions) cannot all be had, ([], the constrained names
    pip's explanation names: a version the index lacks, or one another package cannot take). A
    requirement with only a source distribution is built into `local` (pure Python only) and pip
    asked again."""
    target = target_args(python_version, glibc)
    for _ in range(MAX_SOURCE_BUILDS + 1):
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            (Path(tmp) / "image.txt").write_text("".join(f"{c}\n" for c in constraints))
            # not --quiet: pip's explanation of a conflict names the packages in it
            r = _pip("install", "--dry-run", "--ignore-installed", "--report", str(report),
                     "--find-links", str(local), "--target", str(Path(tmp) / "t"), *target,
                     *(["-c", str(Path(tmp) / "image.txt")] if constraints else []), *reqs, capture=True)
            if r.returncode == 0:
                return json.loads(report.read_text())["install"], []
        req = missing_wheel(r.stderr)
        if _UNREACHABLE.search(r.stderr):
            raise SystemExit(pip_failed(["resolve", *reqs], r.stderr))
        if conflict_names(r.stderr, constraints):
            return [], conflict_names(r.stderr, constraints)
        held = {_name_of(c) for c in constraints}
        if req is not None and _name_of(req) in held:
            return [], [_name_of(req)]  # a requirement no held version meets: pip says "no version" then
        # pip < 24 checks a dry run's Requires-Python against the interpreter running it, not the
        # target's: a held version for a newer Python than this one is then refused as a conflict
        python = _OTHER_PYTHON.search(r.stderr)
        if python and _canonical(python.group(1)) in held:
            return [], [_canonical(python.group(1))]
        if req is None:
            raise SystemExit(pip_failed(["resolve", *reqs], r.stderr))
        print(f"{req}: no wheel for the target; building a pure-Python wheel of it here")
        build_pure_wheel(req, local)
    raise SystemExit(f"more than {MAX_SOURCE_BUILDS} source-only packages; giving up")


def resolve_against(reqs: List[str], python_version: str, glibc: str, local: Path,
                    image: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, str], Dict[str, str]]:
    """({name: version} pip resolves for `reqs`, {name: the image's version} of those the image
    serves), names canonical. Without the image's list the image serves nothing here (the callers
    fall back to WITH_TORCH). With it, pip resolves again holding each served package at the
    image's version, so that those versions' own requirements are checked too, and every other
    package at the version it just resolved (one candidate each: pip answers at once instead of
    backtracking through the index); a package pip's conflict explanation names is then carried
    (an image's) or left to pip (another), and pip asked again, until no more are served."""
    items = resolve_items(reqs, python_version, glibc, local)[0]
    held: Dict[str, str] = {}  # the image's versions `items` was resolved with
    refused: set = set()  # image packages pip could not hold: carried
    free: set = set()  # packages pip may move to make room for the image's
    for _ in range(MAX_IMAGE_ROUNDS if image else 0):
        serve = {n: v for n, v in served(items, image, reqs, python_version).items() if n not in refused}
        if serve == held:
            break
        # what a held package requires follows the image's version of it (torch 2.11 pins its CUDA
        # libraries), not the version resolved first: left to pip from the start
        free |= required_by(items, serve, reqs, python_version) - set(serve)
        pins = {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
        pins = {**{n: v for n, v in pins.items() if n not in free}, **{n: constraint(v) for n, v in serve.items()}}
        got, conflicts = resolve_items(reqs, python_version, glibc, local, [f"{n}=={v}" for n, v in sorted(pins.items())])
        if conflicts:
            refused.update(n for n in conflicts if n in serve)
            free.update(n for n in conflicts if n not in serve)
        else:
            items, held = got, serve
    versions = {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    return versions, held


FILES = "FILES"  # the names of what the folder's last build wrote (outdir.py: nothing else is touched)


def owned(out: Path) -> List[str]:
    """What this command's last run wrote in `out` (FILES and the names it lists), [] without FILES."""
    listed = out / FILES
    if not listed.is_file():
        return []
    # plain names only: a FILES naming '../x' must not make publish delete outside OUT
    return [FILES] + [n for n in listed.read_text().split() if "/" not in n and n not in (".", "..")]


def carried_pins(resolved: Dict[str, str], serves: Optional[Dict[str, str]]) -> Dict[str, str]:
    """What the folder carries: without the image's list, all but torch's install (WITH_TORCH);
    with it (`serves`: what the image serves), all the image does not serve."""
    return {n: v for n, v in resolved.items() if (n not in serves if serves is not None else carried(n))}


def prepare(out: Path, python_version: str, glibc: str, reqs: Optional[List[str]] = None,
            image: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """Build the folder in OUT's partial folder, then publish it over the last build's files."""
    old = owned(out)
    outdir.refuse_foreign(out, old, f"a wheel folder this command built ({FILES} and the files it names)")
    work = outdir.partial(out)
    try:
        resolved, serves = resolve_against(reqs or requirements(), python_version, glibc, work, image)
        pins = carried_pins(resolved, serves if image else None)
        _pip("download", "--no-deps", "--quiet", "--find-links", str(work), "--find-links", str(out),
             "--dest", str(work), *target_args(python_version, glibc), *[f"{n}=={v}" for n, v in sorted(pins.items())])
        (work / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
        (work / "TARGET").write_text(f"python {python_version}, glibc >= {glibc}, x86_64\n" + (
            f"over the image's packages: {', '.join(f'{n}=={v}' for n, v in sorted(serves.items()))}\n" if image else ""))
        names = sorted(p.name for p in work.iterdir())
        (work / FILES).write_text("".join(f"{n}\n" for n in names))
    except BaseException:
        outdir.discard(out)  # OUT as it was: the last build's files, nothing half-written
        raise
    outdir.publish(out, old, names + [FILES], FILES)
    return {w.name: w.stat().st_size for w in sorted(out.glob("*.whl"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    who = ap.add_mutually_exclusive_group()
    who.add_argument("--python-version", help="the GPU machine's Python, X.Y (default: this interpreter's)")
    who.add_argument("--target-python", help="an interpreter of the target: its version and glibc are used")
    ap.add_argument("--glibc", help="the GPU machine's glibc (x86_64 Linux); default 2.28, or the "
                    "target interpreter's")
    ap.add_argument("--with-project", action="store_true",
                    help="also the project's own dependencies (setup.py CORE: pyarrow, submitit, ...), "
                         "which the demo needs; larger than 64 MiB, so the limit is not enforced")
    ap.add_argument("--image", type=Path, help="the GPU node's package list (python -m verl_hpc.gpu_check.image "
                                              "list there): carry only what it does not serve")
    ap.add_argument("--requirement", action="append", help=argparse.SUPPRESS)  # tests: other pins
    args = ap.parse_args(argv)
    for option, value in (("--python-version", args.python_version), ("--glibc", args.glibc)):
        if value is not None and not re.fullmatch(r"\d+\.\d+", value):  # before pip spends minutes on it
            ap.error(f"{option}: got {value!r}; valid: X.Y, e.g. 3.12 (Python) or 2.28 (glibc)")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"OUT '{args.out}' is a file; valid: a folder (new, or one this command wrote)")
    reqs = args.requirement or requirements()
    if args.with_project:
        reqs = merged(reqs, project_requirements())
    python_version, glibc = args.python_version, args.glibc
    if args.target_python:
        python_version, found = probe_target(args.target_python)
        glibc = glibc or found
    python_version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    glibc = glibc or "2.28"
    print(f"target: Python {python_version}, glibc >= {glibc}")
    try:
        image = read_list(args.image) if args.image else None
        sizes = prepare(args.out, python_version, glibc, reqs, image)
    except KitError as e:
        print(f"wheels: {e}", file=sys.stderr)
        return 1
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    for name, size in sizes.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{total / 2**20:8.2f} MiB  total in {args.out} ({len(sizes)} wheels; limit 64 MiB)")
    sdists = sorted(p.name for p in args.out.iterdir() if p.suffix in (".gz", ".zip", ".bz2"))
    if sdists:
        print(f"source distributions in the folder (the GPU machine would have to build them): {sdists}",
              file=sys.stderr)
        return 1
    if total >= LIMIT_BYTES and not args.with_project:
        print(f"too large: {total / 2**20:.2f} MiB >= 64 MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
