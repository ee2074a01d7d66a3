"""The GPU kits' builders and installers on bad input (vllm_kit.py, wheels.py, vllm_pieces.py):
each fault is one line naming the file or field and what is valid, exit 1, and nothing is left
half-written; a builder never deletes a file it did not write. No network: pip is faked, or pointed
at an index that refuses connections."""
import errno
import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from verl_hpc.gpu_check import outdir, vllm_kit, vllm_pieces, wheels

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def no_pip(*args, **kwargs):
    raise AssertionError(f"pip was called ({args[:2]}): the folder should have been refused first")


def make_kit(folder: Path, members, mode: str = "w:xz", piece_bytes: int = 300, **about) -> Path:
    """A kit folder (pieces + manifest) around a tar of `members` ({name: bytes}) packed with `mode`."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder.parent / f"{folder.name}-{vllm_pieces.ARCHIVE}"
    with tarfile.open(archive, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = archive.rename(folder.parent / vllm_pieces.ARCHIVE)
    pieces = vllm_pieces.split(archive, folder, piece_bytes)
    vllm_pieces.write_manifest(folder, archive, pieces, vllm=vllm_kit.VLLM_VERSION, **about)
    archive.unlink()
    return folder


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / vllm_pieces.MANIFEST).read_text())


# ------------------------------------------------------------------------------ the output folders
def test_vllm_kit_into_a_folder_holding_a_users_file_stops_and_keeps_it(tmp_path, monkeypatch, capsys):
    """Before: build() deleted every file of OUT, then downloaded."""
    out = tmp_path / "kit"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    monkeypatch.setattr(wheels, "_pip", no_pip)
    assert vllm_kit.main([str(out), "--cache", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"vllm_kit: {out}: holds notes.txt, which this command did not write")
    assert (out / "notes.txt").read_text() == "mine\n" and sorted(os.listdir(out)) == ["notes.txt"]


def test_vllm_kit_replaces_its_previous_kit_and_an_interrupted_build_leaves_it(tmp_path, monkeypatch):
    out = make_kit(tmp_path / "kit", {"requirements.txt": os.urandom(1500)}, piece_bytes=400)
    old = sorted(os.listdir(out))
    assert len(old) > 2  # the manifest and several pieces

    def interrupted(work, *args):
        (work / "vllm_kit.tar.xz.001").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(vllm_kit, "_build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        vllm_kit.build(out, "3.12", "2.31", 48, tmp_path / "cache")
    assert sorted(os.listdir(out)) == old  # the old kit whole, no partial folder

    def rebuilt(work, *args):  # a new kit of one piece
        made = make_kit(tmp_path / "new", {"requirements.txt": b"vllm==0.25.0\n"}, piece_bytes=10**6)
        for f in made.iterdir():
            os.replace(f, work / f.name)
        return manifest_of(work)

    monkeypatch.setattr(vllm_kit, "_build", rebuilt)
    manifest = vllm_kit.build(out, "3.12", "2.31", 48, tmp_path / "cache")
    assert sorted(os.listdir(out)) == [vllm_pieces.MANIFEST, "vllm_kit.tar.xz.001"]
    assert manifest_of(out) == manifest and vllm_pieces.verify(out) == manifest


def test_a_folder_whose_manifest_is_not_a_kits_is_refused_before_any_download(tmp_path, monkeypatch, capsys):
    out = tmp_path / "kit"
    out.mkdir()
    (out / vllm_pieces.MANIFEST).write_text("[1, 2]\n")
    monkeypatch.setattr(wheels, "_pip", no_pip)
    assert vllm_kit.main([str(out), "--cache", str(tmp_path / "cache")]) == 1
    assert "a JSON list; valid: an object" in capsys.readouterr().err
    assert (out / vllm_pieces.MANIFEST).read_text() == "[1, 2]\n"


def test_the_wheel_folder_refuses_a_users_file_and_replaces_its_own_build(tmp_path, monkeypatch, capsys):
    """wheels.py never deleted, but it mixed: a user's file was counted, carried, and a user's
    .tar.gz failed the build after the downloads."""
    out = tmp_path / "wheels"
    out.mkdir()
    (out / "data.tar.gz").write_bytes(b"mine")
    monkeypatch.setattr(wheels, "_pip", no_pip)
    assert wheels.main([str(out), "--python-version", "3.12", "--requirement", "tqdm==4.67.1"]) == 1
    assert capsys.readouterr().err.strip().startswith(f"wheels: {out}: holds data.tar.gz, which this command did not write")
    (out / "data.tar.gz").unlink()

    def fake_pip(*args, capture=False):  # `download` writes the pinned wheels where it is told
        dest = Path(args[args.index("--dest") + 1])
        for pin in (a for a in args if "==" in a):
            (dest / "{}-{}-py3-none-any.whl".format(*pin.split("=="))).write_bytes(b"w")
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(wheels, "_pip", fake_pip)
    monkeypatch.setattr(wheels, "resolve_against", lambda reqs, *a: ({"tqdm": "4.67.1", "rich": "14.0.0"}, {}))
    wheels.prepare(out, "3.12", "2.28", ["tqdm"])
    first = sorted(os.listdir(out))
    assert first == ["FILES", "TARGET", "requirements.txt", "rich-14.0.0-py3-none-any.whl", "tqdm-4.67.1-py3-none-any.whl"]
    monkeypatch.setattr(wheels, "resolve_against", lambda reqs, *a: ({"tqdm": "4.67.2"}, {}))
    (tmp_path / "outside.txt").write_text("mine\n")
    with open(out / "FILES", "a") as f:  # a list naming a path outside OUT is not followed there
        f.write("../outside.txt\n")
    wheels.prepare(out, "3.12", "2.28", ["tqdm"])
    assert sorted(os.listdir(out)) == ["FILES", "TARGET", "requirements.txt", "tqdm-4.67.2-py3-none-any.whl"]
    assert (tmp_path / "outside.txt").read_text() == "mine\n"


# -------------------------------------------------------------------------------- the manifest
GOOD_PIECE = {"name": "vllm_kit.tar.xz.001", "bytes": 10, "sha256": "0" * 64}


@pytest.mark.parametrize("manifest, words", [
    ([1, 2], "a JSON list; valid: an object"),
    ("kit", "a JSON str; valid: an object"),
    ({"format": 1, "pieces": [{"name": "a.001", "bytes": 10}]}, "pieces[0] has no sha256; valid: 64 hex digits"),
    ({"format": 1, "pieces": [{"bytes": 10, "sha256": "0" * 64}]}, "pieces[0] has no name; valid: a file name"),
    ({"format": 1, "pieces": [{"name": "a.001", "sha256": "0" * 64}]}, "pieces[0] has no bytes"),
    ({"format": 1, "pieces": [{"name": "a.001", "bytes": "10", "sha256": "0" * 64}]},
     "pieces[0].bytes is '10'; valid: a positive integer"),
    ({"format": 1, "pieces": [{"name": "../a.001", "bytes": 10, "sha256": "0" * 64}]},
     "pieces[0].name is '../a.001'; valid: a file name"),
    ({"format": 1, "pieces": ["a.001"]}, "pieces[0] is str; valid: an object"),
    ({"format": 1, "pieces": {"a": 1}}, "pieces is {'a': 1}; valid: a list"),
    ({"format": 1, "pieces": [GOOD_PIECE]}, "no archive; valid: an object"),
    ({"format": 1, "pieces": [GOOD_PIECE], "archive": GOOD_PIECE, "glibc": "abc"}, "glibc is 'abc'; valid: X.Y"),
    ({"format": 1, "pieces": [GOOD_PIECE], "archive": GOOD_PIECE, "glibc": "2.x"}, "glibc is '2.x'; valid: X.Y"),
    ({"format": 1, "pieces": [GOOD_PIECE], "archive": GOOD_PIECE, "glibc": 2.31}, "glibc is 2.31; valid: X.Y"),
    ({"format": 1, "pieces": [GOOD_PIECE], "archive": GOOD_PIECE, "image": ["numpy"]}, "image is ['numpy']"),
])
def test_a_malformed_manifest_is_one_line_naming_the_field(tmp_path, manifest, words, capsys):
    """Before: a list raised AttributeError, a piece without sha256 KeyError, glibc 'abc' ValueError."""
    (tmp_path / vllm_pieces.MANIFEST).write_text(json.dumps(manifest))
    for cmd in (["verify", str(tmp_path)], ["install", str(tmp_path)], ["stash", str(tmp_path), "--home", str(tmp_path / "h")]):
        assert vllm_pieces.main(cmd) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"vllm kit: {tmp_path / vllm_pieces.MANIFEST}: {words}"), err
    assert not (tmp_path / "h").exists()


# ------------------------------------------------------------------------------ the archive
def test_a_gzip_archive_where_xz_is_expected_is_one_line_and_nothing_stays_unpacked(tmp_path, capsys):
    kit = make_kit(tmp_path / "kit", {"requirements.txt": b"vllm==0.25.0\n"}, mode="w:gz")
    assert vllm_pieces.main(["install", str(kit)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vllm kit: vllm_kit.tar.xz: not an xz-compressed tar"), err
    assert sorted(os.listdir(kit)) == sorted([vllm_pieces.MANIFEST] + [p["name"] for p in manifest_of(kit)["pieces"]])


def test_a_member_that_would_land_outside_the_folder_is_refused_by_name(tmp_path, capsys):
    kit = make_kit(tmp_path / "kit", {"requirements.txt": b"vllm==0.25.0\n", "../escaped.txt": b"x"})
    assert vllm_pieces.main(["install", str(kit)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "member '../escaped.txt' would land outside" in err, err
    assert not (tmp_path / "escaped.txt").exists() and not (kit / "unpacked").exists()


# --------------------------------------------------------------- folders that cannot be written
def erofs(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]) if args else None)


def test_a_read_only_home_or_target_is_one_line_and_the_source_keeps_its_piece(tmp_path, monkeypatch, capsys):
    """Tests run as root, where chmod does not stop a write: the read-only file system is a
    monkeypatched write raising EROFS, and a "folder" under a plain file is really unwritable."""
    kit = make_kit(tmp_path / "kit", {"requirements.txt": b"vllm==0.25.0\n"})
    (tmp_path / "file").write_text("a plain file\n")
    assert vllm_pieces.main(["stash", str(kit), "--home", str(tmp_path / "file" / "home")]) == 1
    err = capsys.readouterr().err
    assert err == f"vllm kit: --home {tmp_path / 'file' / 'home'}: cannot write there (Not a directory); " \
                  "valid: a folder this user may write\n"
    assert vllm_pieces.main(["install", str(kit), "--target", str(tmp_path / "file" / "site")]) == 1
    assert capsys.readouterr().err.startswith(f"vllm kit: --target {tmp_path / 'file' / 'site'}: cannot write there")
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_bytes", erofs)
        assert vllm_pieces.main(["stash", str(kit), "--home", str(tmp_path / "home")]) == 1
    assert capsys.readouterr().err.endswith("cannot write there (Read-only file system); valid: a folder this user may write\n")
    assert all((kit / p["name"]).is_file() for p in manifest_of(kit)["pieces"])  # nothing moved
    assert [p.name for p in (tmp_path / "home").iterdir()] == []  # nothing half-written


def test_a_read_only_source_still_stashes_and_a_foreign_home_file_stays(tmp_path, monkeypatch):
    kit = make_kit(tmp_path / "kit", {"requirements.txt": b"vllm==0.25.0\n"})
    home = tmp_path / "home"
    home.mkdir()
    (home / "mine.txt").write_text("mine\n")
    (home / vllm_pieces.MANIFEST).write_text(json.dumps({**manifest_of(kit), "vllm": "another build"}))
    real_unlink = pathlib.Path.unlink

    def read_only_source(self, *args, **kwargs):
        if self.parent == kit:
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only_source)
    moved = vllm_pieces.stash(kit, home)
    assert moved == [p["name"] for p in manifest_of(kit)["pieces"]]
    assert (home / "mine.txt").read_text() == "mine\n"  # another build's home loses its pieces only
    assert vllm_pieces.verify(home) == manifest_of(kit)
    assert not [p for p in home.iterdir() if p.name.endswith(".partial")]


def test_a_read_only_output_folder_stops_the_builders_before_any_download(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wheels, "_pip", no_pip)
    (tmp_path / "file").write_text("a plain file\n")
    assert vllm_kit.main([str(tmp_path / "file" / "kit"), "--cache", str(tmp_path / "cache")]) == 1
    assert capsys.readouterr().err == f"vllm_kit: {tmp_path / 'file' / 'kit'}: cannot write there (Not a directory); " \
                                      "valid: a folder this user may write\n"
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_bytes", erofs)
        assert wheels.main([str(tmp_path / "wheels"), "--python-version", "3.12", "--requirement", "tqdm"]) == 1
    assert capsys.readouterr().err == f"wheels: {tmp_path / 'wheels'}: cannot write there (Read-only file system); " \
                                      "valid: a folder this user may write\n"
    assert os.listdir(tmp_path / "wheels") == []  # the partial folder went with the failure
    with monkeypatch.context() as m:
        m.setattr(outdir, "partial", lambda out: out)  # OUT is fine; the cache is under a file
        assert vllm_kit.main([str(tmp_path / "kit"), "--cache", str(tmp_path / "file" / "cache")]) == 1
    assert capsys.readouterr().err.startswith(f"vllm_kit: --cache {tmp_path / 'file' / 'cache'}: cannot write there")


# ---------------------------------------------------------------------- no package index
def unreachable_index(monkeypatch):
    """pip with no configuration but an index on a closed local port (one retry: its WARNING)."""
    for var in [v for v in os.environ if v.startswith("PIP_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")
    monkeypatch.setenv("PIP_TIMEOUT", "2")


@pytest.mark.heavy  # starts pip (twice)
def test_no_reachable_index_is_one_line_naming_the_package(tmp_path, monkeypatch):
    unreachable_index(monkeypatch)
    r = subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check.vllm_kit", str(tmp_path / "kit"), "--cache",
                        str(tmp_path / "cache")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith(f"pip download vllm=={vllm_kit.VLLM_VERSION}: the package index was unreachable: "
                               "ERROR: "), r.stderr
    assert os.listdir(tmp_path / "kit") == []  # nothing half-written
    r = subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check.wheels", str(tmp_path / "wheels"),
                        "--python-version", "3.12", "--requirement", "tqdm==4.67.1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("pip resolve tqdm==4.67.1: the package index was unreachable: "), r.stderr
    assert os.listdir(tmp_path / "wheels") == []


def test_a_pip_failure_line_names_the_packages_and_pips_last_error():
    stderr = "WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(...)'\n" \
             "ERROR: No matching distribution found for openai==2.1\n"
    assert wheels.pip_failed(["download", "--no-deps", "--dest", "/d", "openai==2.1", "cbor2==5.7", "a==1", "b==2"],
                             stderr) == ("pip download openai==2.1, cbor2==5.7, a==1 and 1 more: the package index was "
                                         "unreachable: ERROR: No matching distribution found for openai==2.1")
    assert wheels.pip_failed(["download", "x==1"], "ERROR: x-1.whl has an invalid wheel\n").startswith(
        "pip download x==1: pip failed: ERROR: x-1.whl")
