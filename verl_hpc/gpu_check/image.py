"""The GPU node's image: the packages its Python already has, what of a resolution they serve, and
the kit's own prefix over that Python, so that installing the kits leaves the image as it was.

    python -m verl_hpc.gpu_check.image list > image_packages.txt   # on the node: name==version lines
    python -m verl_hpc.gpu_check.image prefix DIR [--record FILE]   # the prefix over this Python
    make gpu-all WHEELS=... VLLM_KIT=...   # makes PREFIX, records the list, runs every step in it

The prefix is a venv of the image's interpreter whose site-packages holds what the kits install,
with a .pth file that adds the image's own site-packages after it (site.addsitedir, so the image's
.pth files still run). Its Python imports the kits' packages first and the image's for the rest;
its pip sees the image's packages as installed (so `pip install --no-index` resolves against them)
and installs into the prefix only, never uninstalling a package outside it. A plain
`--system-site-packages` venv would miss an image whose Python is itself a venv (it sees only the
base interpreter's site-packages), hence the .pth file.

The builders (wheels.py, vllm_kit.py) take the image's list (`--image FILE`, as `list` prints it,
or `pip list --format=freeze`) and carry only what the image does not serve: `served` keeps an image
package where its version meets every requirement on it in the resolution, and the builders then
resolve again with those versions as constraints, so that pip itself checks the whole set.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

from verl_hpc.gpu_check.vllm_pieces import KitError  # one line for a user, exit 1

PREFIX = Path("/tmp/verl_hpc_env")  # outside the tree: kept for the next transfer's gpu-all, as the pieces are
LIST = "image_packages.txt"  # where gpu-all records the image's packages before it installs anything
PTH = "verl_hpc_image.pth"
# the platform the kits are built for (wheels.target_args): a requirement's marker is read for it
TARGET_ENV = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
LIST_CODE = ("import importlib.metadata as m, re\nseen = {}\nfor d in m.distributions():\n"
             "    n = re.sub('[-_.]+', '-', d.metadata['Name'] or '').lower()\n"
             "    if n and n not in seen:\n        seen[n] = d.version\n"  # the first on sys.path is the one imported
             "print(''.join(f'{n}=={v}\\n' for n, v in sorted(seen.items())), end='')")
SITES_CODE = ("import json, os, site; dirs = site.getsitepackages() + ([site.getusersitepackages()] "
              "if site.ENABLE_USER_SITE else []); print(json.dumps([d for d in dirs if os.path.isdir(d)]))")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> Dict[str, str]:
    """{canonical name: version} of an image list (`name==version` lines; '#' comments)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KitError(f"--image {path}: cannot read it ({getattr(e, 'strerror', None) or e})")
    out = {}
    for i, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text)
        if m is None:
            raise KitError(f"--image {path}, line {i}: {text[:80]!r}; valid: name==version lines, as "
                           "`python -m verl_hpc.gpu_check.image list` or `pip list --format=freeze` print them")
        out[canonical(m.group(1))] = m.group(2)
    if not out:
        raise KitError(f"--image {path}: no packages listed; valid: name==version lines of the node's Python")
    return out


def in_force(items: List[Dict], top: Iterable[str], python_version: str) -> List[Tuple[Optional[str], "Requirement"]]:
    """(owner, requirement) of every requirement in force in a resolution (pip's report `install`
    entries): the top-level ones (owner None) and each item's Requires-Dist whose marker holds for
    the target, for the extras asked of it (an extra's requirements count only when some
    requirement in force asks for that extra)."""
    from packaging.requirements import Requirement

    env = dict(TARGET_ENV, python_version=python_version, python_full_version=f"{python_version}.0")
    deps = {canonical(i["metadata"]["name"]): [Requirement(r) for r in i["metadata"].get("requires_dist") or []]
            for i in items}
    wanted: Dict[str, Set[str]] = {n: {""} for n in deps}
    todo = [(None, Requirement(r)) for r in top] + [(n, r) for n, reqs in deps.items() for r in reqs]

    def holds(owner, req) -> bool:  # top-level requirements (owner None) ask for no extra
        extras = wanted.get(owner, {""}) if owner is not None else {""}
        return req.marker is None or any(req.marker.evaluate(dict(env, extra=e)) for e in extras)

    changed = True
    while changed:  # an extra asked of a package brings its extra's requirements into force
        changed = False
        for owner, req in todo:
            name = canonical(req.name)
            if holds(owner, req) and not set(req.extras) <= wanted.setdefault(name, {""}):
                wanted[name] |= set(req.extras)
                changed = True
    return [(owner, req) for owner, req in todo if holds(owner, req)]


def served(items: List[Dict], image: Dict[str, str], top: Iterable[str], python_version: str) -> Dict[str, str]:
    """Of a resolution (pip's report `install` entries), {name: the image's version} of each package
    the image has at a version that every requirement in force on it accepts."""
    from packaging.version import InvalidVersion, Version

    reqs: Dict[str, List] = {}
    for _, req in in_force(items, top, python_version):
        reqs.setdefault(canonical(req.name), []).append(req)
    out = {}
    for item in items:
        n = canonical(item["metadata"]["name"])
        if n not in image:
            continue
        try:
            have = Version(image[n])
        except InvalidVersion:  # not a version pip could compare: the kit carries its own
            continue
        if all(r.specifier.contains(have, prereleases=True) for r in reqs.get(n, [])):
            out[n] = image[n]
    return out


def required_by(items: List[Dict], roots: Iterable[str], top: Iterable[str], python_version: str) -> Set[str]:
    """The names `roots` require in force in a resolution, directly or through each other."""
    deps: Dict[str, Set[str]] = {}
    for owner, req in in_force(items, top, python_version):
        if owner is not None:
            deps.setdefault(owner, set()).add(canonical(req.name))
    seen: Set[str] = set()
    todo = list(roots)
    while todo:
        for d in deps.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def constraint(version: str) -> str:
    """The index's version of an image's build: a local label (torch's +cu130) is the image's own."""
    return version.split("+", 1)[0]


def make_prefix(prefix: Path, base: str = sys.executable, record: Path = None) -> str:
    """The prefix's Python (made once over `base`; a later call reuses it). `record`: where the
    image's package list is written first, before anything is installed."""
    prefix = prefix.absolute()
    py = prefix / "bin" / "python"
    if record is not None:
        listed = _run([base, "-c", LIST_CODE], f"listing {base}'s packages")
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(listed)
        except OSError as e:
            raise KitError(f"{record}: cannot write the image's package list ({e.strerror})")
    if (prefix / "pyvenv.cfg").is_file() and py.exists():
        return str(py)
    if prefix.exists():
        raise KitError(f"{prefix}: exists but is not a prefix this command made (no pyvenv.cfg); "
                       "valid: a new folder (--prefix) or one it made")
    work = prefix.with_name(prefix.name + ".partial")  # made whole, then renamed: never half a prefix
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.parent.mkdir(parents=True, exist_ok=True)
        _run([base, "-m", "venv", "--without-pip", str(work)], f"making the prefix {prefix}")
        sites = json.loads(_run([base, "-c", SITES_CODE], f"reading {base}'s site-packages"))
        purelib = _run([str(work / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       "reading the prefix's site-packages").strip()
        (Path(purelib) / PTH).write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in sites))
        os.replace(work, prefix)
    except OSError as e:
        raise KitError(f"{prefix}: cannot make the prefix there ({e.strerror}); valid: a folder this user may write")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(py)


def inside(prefix: Path) -> bool:
    """Whether this interpreter is the prefix's."""
    return Path(sys.prefix).resolve() == prefix.absolute().resolve()


def chosen(named: Optional[Path], installing: bool, off: bool) -> Optional[Path]:
    """The prefix a command runs in: the one named (--prefix), else PREFIX when it installs a kit or
    when an earlier run made it (a later transfer's run sees what the kits installed, as it did when
    they went into the image), else none: the running Python."""
    if off:
        return None
    if named is None and not (installing or (PREFIX / "pyvenv.cfg").is_file()):
        return None
    return Path(named or PREFIX).absolute()


def relaunch(prefix: Path, out: Path, module: str, argv: List[str], tag: str = "image") -> int:
    """Make (or reuse) the prefix, the image's package list recorded in OUT first, and run
    `python -m module *argv` with the prefix's Python, here: every step it starts, and its own
    summary, then see the prefix's packages over the image's. Its exit code (1: no prefix, with
    one line starting `tag:`)."""
    try:
        py = make_prefix(prefix, record=out / LIST)
    except KitError as e:
        print(f"{tag}: {e}", file=sys.stderr)
        return 1
    print(f"[{tag}] running with {py}: the kits' prefix over {sys.executable}'s packages (listed in {out / LIST})",
          flush=True)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    return subprocess.run([py, "-m", module, *argv], env=env).returncode


def _run(cmd: List[str], what: str) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise KitError(f"{what}: {cmd[0]} did not run ({e})")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KitError(f"{what}: `{' '.join(cmd[:3])}` failed: {last}")
    return r.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_hpc.gpu_check.image", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="this Python's packages, name==version (the builders' --image)")
    p = sub.add_parser("prefix", help="make (or reuse) the kits' prefix over this Python; prints its Python")
    p.add_argument("prefix", type=Path)
    p.add_argument("--record", type=Path, help="write this Python's package list there first")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            print(_run([sys.executable, "-c", LIST_CODE], "listing the packages"), end="")
        else:
            print(make_prefix(args.prefix, record=args.record))
    except KitError as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
