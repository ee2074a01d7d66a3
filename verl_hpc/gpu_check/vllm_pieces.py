"""The vLLM kit's pieces: split and manifest (here), then, on the offline GPU node, stash each
carried piece, verify them all, assemble, install. Standard library only: it runs on the node
before anything of the kit is installed.

    python -m verl_hpc.gpu_check.vllm_pieces stash KIT_DIR      # each transfer: its piece(s) -> HOME
    python -m verl_hpc.gpu_check.vllm_pieces verify [DIR]       # every piece against the manifest
    python -m verl_hpc.gpu_check.vllm_pieces install [DIR]      # verify, assemble, pip install offline

A transfer to the node carries at most 64 MiB with the work tree, so the kit (vllm_kit.py builds
it) is one xz-compressed tar cut into pieces, with MANIFEST.json: each piece's name, size and
sha256, and the whole archive's. Each transfer carries the manifest and one piece; `stash` checks
the piece against the manifest at once (a damaged transfer is re-sent within the same session) and
moves it to HOME (/tmp/verl_hpc_vllm_kit: outside the tree, kept between the calls of a session).
The last transfer's `install` (or `make gpu-all ... --vllm-kit HOME`) checks every piece, names a
missing or damaged one in one line, joins them, checks the archive's sha256, unpacks it and runs
`pip install --no-index --no-deps --find-links DIR -r DIR/requirements.txt` with the node's Python
(gpu-all's: the kits' prefix over the image, image.py): the requirements are exactly the resolved
pins, so pip neither resolves nor reaches a network. Every fault (a malformed manifest field, an
archive that is not xz or has a member outside the folder, a folder that cannot be written) is one
KitError line; files land under temporary names and an unpacked folder is removed on failure, so
nothing half-written stays.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Dict, List, Optional

MANIFEST = "MANIFEST.json"
FORMAT = 1
HOME = Path("/tmp/verl_hpc_vllm_kit")
ARCHIVE = "vllm_kit.tar.xz"
MIB = 2**20
PIECE_LIMIT = 60 * MIB  # a piece and the work tree (~7 MB) stay under a transfer's 64 MiB


class KitError(Exception):  # not a VerlHpcError: this module imports nothing of verl_hpc
    """A one-line problem with the kit (a missing or damaged piece, a foreign manifest)."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def split(archive: Path, out: Path, piece_bytes: int) -> List[Dict]:
    """Cut `archive` into out/<name>.001, .002, ... of at most piece_bytes each."""
    if not 0 < piece_bytes <= PIECE_LIMIT:
        raise KitError(f"piece size {piece_bytes} bytes; valid: 1 .. {PIECE_LIMIT} ({PIECE_LIMIT // MIB} MiB)")
    pieces = []
    with open(archive, "rb") as f:
        while True:
            data = f.read(piece_bytes)
            if not data:
                break
            path = out / f"{archive.name}.{len(pieces) + 1:03d}"
            path.write_bytes(data)
            pieces.append({"name": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return pieces


def write_manifest(out: Path, archive: Path, pieces: List[Dict], **about) -> Dict:
    manifest = {"format": FORMAT, **about,
                "archive": {"name": archive.name, "bytes": archive.stat().st_size, "sha256": sha256(archive)},
                "pieces": pieces}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(folder: Path) -> Dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise KitError(f"{path}: no manifest (carry the kit folder's {MANIFEST} with each piece)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise KitError(f"{path}: not JSON ({getattr(e, 'strerror', None) or e}); rebuild the kit (make gpu-vllm-kit)")
    problem = manifest_problem(manifest)
    if problem:
        raise KitError(f"{path}: {problem} (make gpu-vllm-kit writes it)")
    return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")
# a piece's name is a plain file name: a manifest naming '../x' must not reach outside the folder
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _entry_problem(where: str, entry) -> str:
    """Why a piece or archive entry of the manifest is malformed, or ''."""
    if not isinstance(entry, dict):
        return f"{where} is {type(entry).__name__}; valid: an object with name, bytes, sha256"
    for field, ok, valid in (("name", lambda v: isinstance(v, str) and _NAME.fullmatch(v), "a file name"),
                             ("bytes", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                              "a positive integer"),
                             ("sha256", lambda v: isinstance(v, str) and _SHA256.fullmatch(v), "64 hex digits")):
        if field not in entry:
            return f"{where} has no {field}; valid: {valid}"
        if not ok(entry[field]):
            return f"{where}.{field} is {entry[field]!r}; valid: {valid}"
    return ""


def manifest_problem(manifest) -> str:
    """Why a parsed manifest is not one this module can use (field and what is valid), or ''."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}; valid: an object (format {FORMAT}, archive, pieces)"
    if manifest.get("format") != FORMAT:
        return f"format is {manifest.get('format')!r}; valid: {FORMAT}"
    pieces = manifest.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        return f"pieces is {pieces!r:.60}; valid: a list of at least one piece"
    problems = [_entry_problem(f"pieces[{i}]", p) for i, p in enumerate(pieces)]
    problems.append(_entry_problem("archive", manifest.get("archive")) if "archive" in manifest
                    else "no archive; valid: an object with name, bytes, sha256")
    glibc = manifest.get("glibc")
    if glibc is not None and not (isinstance(glibc, str) and re.fullmatch(r"\d+\.\d+", glibc)):
        problems.append(f"glibc is {glibc!r}; valid: X.Y, e.g. 2.31")
    image = manifest.get("image", {})
    if not (isinstance(image, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in image.items())):
        problems.append(f"image is {image!r:.60}; valid: an object of package: version")
    return next((p for p in problems if p), "")


def piece_problem(folder: Path, piece: Dict) -> str:
    """Why this piece in `folder` is unusable, or ''."""
    path = folder / piece["name"]
    if not path.is_file():
        return f"piece {piece['name']} missing from {folder}"
    size = path.stat().st_size
    if size != piece["bytes"]:
        return f"piece {piece['name']} damaged: {size} bytes, the manifest says {piece['bytes']}"
    if sha256(path) != piece["sha256"]:
        return f"piece {piece['name']} damaged: its sha256 differs from the manifest's"
    return ""


def verify(folder: Path, present_only: bool = False) -> Dict:
    """The manifest, once every piece (or, with present_only, every piece that is there, at least
    one) matches it; else KitError naming the first bad piece and how many are bad."""
    manifest = read_manifest(folder)
    pieces = manifest["pieces"]
    if present_only:
        pieces = [p for p in pieces if (folder / p["name"]).exists()]
        if not pieces:
            raise KitError(f"{folder}: none of the manifest's {len(manifest['pieces'])} pieces is there")
    problems = [why for why in map(lambda p: piece_problem(folder, p), pieces) if why]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise KitError(problems[0] + more)
    return manifest


def _writable(folder: Path, role: str) -> None:
    """KitError naming `folder` when it cannot be made or written (a read-only file system, a file
    where a folder is expected), before anything is written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".{MANIFEST}.probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise KitError(f"{role} {folder}: cannot write there ({e.strerror}); valid: a folder this user may write")


def _copy_whole(src: Path, dest: Path) -> None:
    """Copy under a temporary name, then rename: `dest` is never half a file."""
    tmp = dest.with_name(f".{dest.name}.partial")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def stash(src: Path, home: Path = HOME) -> List[str]:
    """Check the pieces carried in `src` and move them into `home` with the manifest. A home that
    holds another build's pieces loses those (its manifest names them), nothing else of it."""
    manifest = verify(src, present_only=True)
    _writable(home, "--home")
    if (home / MANIFEST).is_file() and (home / MANIFEST).read_text() != (src / MANIFEST).read_text():
        try:
            old = [p["name"] for p in read_manifest(home)["pieces"]]
        except KitError:  # a manifest no build of this module wrote: its pieces are not known
            old = []
        for name in old:
            (home / name).unlink(missing_ok=True)
    _copy_whole(src / MANIFEST, home / MANIFEST)
    moved = []
    for piece in manifest["pieces"]:
        if (src / piece["name"]).is_file():
            _copy_whole(src / piece["name"], home / piece["name"])
            try:
                (src / piece["name"]).unlink()  # moved: the tree's copy is not carried again
            except OSError:  # a read-only source: the piece is stashed all the same
                pass
            moved.append(piece["name"])
    return moved


def assemble(folder: Path, dest: Path) -> Path:
    """Every piece checked, joined, the archive's sha256 checked, unpacked into `dest` (a new
    folder: on any failure it is removed whole, so nothing half-unpacked stays)."""
    manifest = verify(folder)
    if dest.exists():
        raise KitError(f"{dest}: exists; valid: a new folder to unpack the kit into")
    _writable(dest, "unpacking into")
    try:
        _unpack(folder, manifest, dest)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def _unpack(folder: Path, manifest: Dict, dest: Path) -> None:
    archive = dest / manifest["archive"]["name"]
    try:
        with open(archive, "wb") as out:
            for piece in manifest["pieces"]:
                with open(folder / piece["name"], "rb") as f:
                    shutil.copyfileobj(f, out, 4 * MIB)
    except OSError as e:
        raise KitError(f"joining the pieces into {archive}: {e.strerror}; valid: a folder with room for "
                       f"{manifest['archive']['bytes'] / MIB:.0f} MiB more")
    if sha256(archive) != manifest["archive"]["sha256"]:
        raise KitError(f"{archive}: the joined pieces' sha256 differs from the manifest's (pieces of two builds?)")
    try:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(dest, filter="data")  # refuses members outside dest, links out, devices
    except (tarfile.ReadError, tarfile.CompressionError, lzma.LZMAError, EOFError) as e:
        raise KitError(f"{archive.name}: not an xz-compressed tar ({e}); rebuild the kit (make gpu-vllm-kit)")
    except tarfile.FilterError as e:
        raise KitError(f"{archive.name}: member {e.tarinfo.name!r} would land outside {dest} or is not a plain "
                       f"file ({type(e).__name__}); valid: an archive vllm_kit.py packed")
    except OSError as e:
        raise KitError(f"unpacking {archive.name} into {dest}: {e.strerror or e} ({e.filename or dest})")
    archive.unlink()
    if not (dest / "requirements.txt").is_file():
        raise KitError(f"{dest}: the archive has no requirements.txt; rebuild the kit (make gpu-vllm-kit)")


def glibc_problem(needed: Optional[str], found: Optional[str] = None) -> None:
    """KitError when this machine's glibc is older than the kit's wheels need (their manylinux tag)."""
    import platform

    if found is None:
        lib, found = platform.libc_ver()
        found = found if lib == "glibc" else ""
    if needed and found and tuple(map(int, found.split(".")[:2])) < tuple(map(int, needed.split("."))):
        raise KitError(f"this machine's glibc {found} is older than the {needed} the kit's wheels were "
                       f"picked for (vllm_kit --glibc; llguidance, which vLLM needs, has none older than 2.31)")


IMPORT_PROBE = "import vllm; from vllm import LLM; print('vllm', vllm.__version__, 'from', vllm.__file__)"
# {canonical name: version} of what an interpreter imports (the first of a name on sys.path)
VERSIONS_PROBE = ("import importlib.metadata as m, json, re\nseen = {}\nfor d in m.distributions():\n"
                  "    seen.setdefault(re.sub('[-_.]+', '-', d.metadata['Name'] or '').lower(), d.version)\n"
                  "print(json.dumps(seen))")


def image_problem(relied: Dict[str, str], python: str, env: Dict[str, str]) -> None:
    """KitError when the node's Python lacks a package the kit was built to take from the image
    (vllm_kit --image), at the version it was resolved with."""
    if not relied:
        return
    r = subprocess.run([python, "-c", VERSIONS_PROBE], capture_output=True, text=True, env=env)
    have = json.loads(r.stdout) if r.returncode == 0 else {}
    bad = [f"{n} {v} (here: {have.get(n, 'none')})" for n, v in sorted(relied.items()) if have.get(n) != v]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise KitError(f"the kit was built over an image with {', '.join(bad[:3])}{more}; build it with --image "
                       "from this node's list (python -m verl_hpc.gpu_check.image list)")


def install(folder: Path, python: str = sys.executable, work: Optional[Path] = None,
            target: Optional[Path] = None) -> str:
    """Assemble and install with `python`'s pip, offline, exactly the pinned wheels (into its
    environment, or into `target`, a folder for PYTHONPATH); then import vLLM in a fresh
    interpreter. Returns what that import printed. The unpacked wheels are removed either way."""
    manifest = read_manifest(folder)
    glibc_problem(manifest.get("glibc"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target or ""), os.environ.get("PYTHONPATH")])))
    image_problem(manifest.get("image", {}), python, env)
    if target is not None:
        _writable(target, "--target")
    work = work or folder / "unpacked"
    shutil.rmtree(work, ignore_errors=True)  # this function's own, left by a run that was killed
    assemble(folder, work)
    try:
        cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-warn-conflicts", "--no-compile",
               "-q", "--find-links", str(work), "-r", str(work / "requirements.txt")]
        cmd += ["--target", str(target)] if target is not None else []
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()] or ["(no output)"]
            last = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1])
            raise KitError(f"pip install --no-index from {work} failed (exit {r.returncode}): {last.strip()}")
        r = subprocess.run([python, "-c", IMPORT_PROBE], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise KitError(f"installed, but `from vllm import LLM` fails: {last}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r.stdout.strip()


def probe(python: str = sys.executable, target: Optional[Path] = None) -> int:
    """The installed kit's engine imports (vllm_kit_probe.py) in a fresh interpreter: its exit code."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target or ""), str(root),
                                                                    os.environ.get("PYTHONPATH")])))
    return subprocess.run([python, "-m", "verl_hpc.gpu_check.vllm_kit_probe"], env=env, cwd=root).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_hpc.gpu_check.vllm_pieces",
                                 description="The vLLM kit's pieces on the GPU node: stash, verify, install.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stash", help="check the carried piece(s) in KIT_DIR and move them to --home")
    s.add_argument("kit_dir", type=Path)
    for name in ("verify", "install"):
        p = sub.add_parser(name, help="every piece against the manifest" + (", then assemble and pip install "
                                                                             "offline" if name == "install" else ""))
        p.add_argument("folder", type=Path, nargs="?", default=None, help=f"default: --home ({HOME})")
        if name == "install":
            p.add_argument("--target", type=Path, help="install into this folder (for PYTHONPATH) instead "
                                                       "of the running Python's environment")
    for p in sub.choices.values():
        p.add_argument("--home", type=Path, default=HOME, help=f"where the pieces gather (default {HOME})")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "stash":
            moved = stash(args.kit_dir, args.home)
            have = [p["name"] for p in read_manifest(args.home)["pieces"] if (args.home / p["name"]).is_file()]
            total = len(read_manifest(args.home)["pieces"])
            print(f"stashed {', '.join(moved)} in {args.home}: {len(have)} of {total} pieces there")
        elif args.cmd == "verify":
            m = verify(args.folder or args.home)
            print(f"{len(m['pieces'])} pieces, {m['archive']['bytes'] / MIB:.1f} MiB: all match the manifest")
        else:
            print(install(args.folder or args.home, target=args.target))
            return probe(target=args.target)
    except KitError as e:
        print(f"vllm kit: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # any other file that cannot be read or written: named, in one line
        print(f"vllm kit: {e.filename or args.cmd}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
