"""The vLLM kit for an offline GPU node (verl_hpc/gpu_check/vllm_kit.py builds it, vllm_pieces.py
stashes, verifies, assembles and installs it there), on a small synthetic kit: the slim wheel's
drop rule and RECORD, the pins it carries, the pieces and their manifest, the one-line errors for a
missing or damaged piece, and an offline install from the assembled pieces. The real kit's
assembled install (torch 2.11, the CUDA wheel) is `make gpu-vllm-kit-check`."""
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from verl_hpc.gpu_check import vllm_kit, vllm_pieces
from verl_hpc.gpu_check.vllm_pieces import KitError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _record_line(name: str, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    return f"{name},sha256={digest},{len(data)}\n"


def fake_vllm_wheel(folder: Path, version: str = vllm_kit.VLLM_VERSION) -> Path:
    """A wheel named and laid out as vLLM's: a module with LLM, the FA2/FA3 extensions (bytes), a
    vendored header tree, METADATA with Requires-Dist, RECORD."""
    files = {
        "vllm/__init__.py": f"__version__ = '{version}'\nclass LLM:\n    pass\n".encode(),
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2" * 1000,
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3" * 1000,
        "vllm/vllm_flash_attn/flash_attn_interface.py": b"# FA4_AVAILABLE = os.path.exists('cute/interface.py')\n",
        "vllm/vllm_flash_attn/cute/interface.py": b"import cutlass\n",
        "vllm/vllm_flash_attn/cute/utils.py": b"import cutlass.cute\n",
        "vllm/_moe_C_stable_libtorch.abi3.so": b"moe" * 100,
        "vllm/_C_stable_libtorch.abi3.so": b"c" * 100,
        "vllm/third_party/deep_gemm/include/a.hpp": b"x",
        "vllm/third_party/pynvml.py": b"# kept\n",
        "vllm/vllm-rs": b"rs",
    }
    dist = f"vllm-{version}.dist-info"
    meta = (f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in
                      [f"{n}>=1" for n in vllm_kit.IMPORT_NEEDS] + ["torch==2.11.0", "pandas; extra == \"bench\""]))
    files[f"{dist}/METADATA"] = meta.encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(_record_line(n, d) for n, d in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{dist}/RECORD", record)
    return path


def test_the_slim_wheel_drops_what_sm90_does_not_load_and_its_record_follows(tmp_path):
    src = fake_vllm_wheel(tmp_path)
    out = tmp_path / "slim"
    out.mkdir()
    gone = vllm_kit.restore(src, out / src.name, vllm_kit.dropped)
    assert set(gone) == {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
                         "vllm/third_party/deep_gemm/include/a.hpp", "vllm/vllm-rs",
                         "vllm/vllm_flash_attn/cute/interface.py", "vllm/vllm_flash_attn/cute/utils.py"}
    with zipfile.ZipFile(out / src.name) as z:
        names = set(z.namelist())
        assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in names and "vllm/_C_stable_libtorch.abi3.so" in names
        assert "vllm/third_party/pynvml.py" in names and not names & set(gone)
        # FA4 without CuTe DSL: vLLM 0.25 counts FA4 available by cute/interface.py's presence alone
        assert "vllm/vllm_flash_attn/flash_attn_interface.py" in names
        assert not any(n.startswith("vllm/vllm_flash_attn/cute/") for n in names)
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}  # xz compresses, not deflate
        record = z.read(f"vllm-{vllm_kit.VLLM_VERSION}.dist-info/RECORD").decode()
        assert not any(g in record for g in gone)
        for line in record.splitlines():  # every kept file's line still matches its bytes
            name, digest, _ = line.split(",")
            if digest:
                assert digest == "sha256=" + hashlib.sha256(z.read(name)).hexdigest(), name
    assert all(vllm_kit.dropped(g) for g in gone) and not vllm_kit.dropped("vllm/_C_stable_libtorch.abi3.so")


def test_the_import_needs_come_with_vllms_own_bounds(tmp_path):
    reqs = vllm_kit.import_requirements(fake_vllm_wheel(tmp_path))
    assert "pydantic>=1" in reqs and "uvloop" in reqs and not any(r.startswith(("torch", "pandas")) for r in reqs)


def test_a_vllm_without_one_of_the_import_needs_is_refused_by_name(tmp_path):
    wheel = fake_vllm_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        items = {n: z.read(n) for n in z.namelist()}
    meta = f"vllm-{vllm_kit.VLLM_VERSION}.dist-info/METADATA"
    items[meta] = items[meta].replace(b"Requires-Dist: cbor2>=1\n", b"")
    with zipfile.ZipFile(wheel, "w") as z:
        for n, d in items.items():
            z.writestr(n, d)
    with pytest.raises(SystemExit, match="does not require cbor2"):
        vllm_kit.import_requirements(wheel)


def test_fa4_is_dropped_with_why_vllm_then_picks_triton_for_head_sizes_over_256():
    why = vllm_kit.dropped("vllm/vllm_flash_attn/cute/flash_fwd_sm90.py")
    assert "cutlass" in why and "Triton attention" in why
    assert not vllm_kit.dropped("vllm/vllm_flash_attn/flash_attn_interface.py")  # FA3's and the availability test


def test_the_kit_carries_what_neither_torch_nor_the_kit_folder_brings():
    joint = {"openai": "2.1", "transformers": "5.19.0", "numpy": "2.4.6", "torch": "2.11.0",
             "typing_extensions": "4.16.0", "nvidia-nccl-cu13": "2.28", "pydantic": "2.14.4", "cbor2": "5.7"}
    base = {"transformers": "5.19.0", "numpy": "2.4.6", "pydantic": "2.14.3"}
    assert vllm_kit.carried_pins(joint, base) == {
        "openai": "2.1", "typing-extensions": "4.16.0", "pydantic": "2.14.4", "cbor2": "5.7"}


def _kit(tmp_path: Path, piece_bytes: int = 4000) -> Path:
    """A kit folder as the builder writes it, around the fake vLLM wheel (one more wheel pinned)."""
    stage = tmp_path / "stage"
    stage.mkdir()
    src = fake_vllm_wheel(tmp_path)
    vllm_kit.restore(src, stage / src.name, vllm_kit.dropped)
    (stage / "requirements.txt").write_text(f"vllm=={vllm_kit.VLLM_VERSION}\n")
    archive = tmp_path / vllm_pieces.ARCHIVE
    vllm_kit.pack([stage / src.name, stage / "requirements.txt"], archive)
    out = tmp_path / "gpu_vllm_kit"
    out.mkdir()
    pieces = vllm_pieces.split(archive, out, piece_bytes)
    vllm_pieces.write_manifest(out, archive, pieces, vllm=vllm_kit.VLLM_VERSION)
    return out


def test_pieces_split_the_archive_and_the_manifest_holds_each_ones_sha256(tmp_path):
    kit = _kit(tmp_path, piece_bytes=400)
    manifest = json.loads((kit / vllm_pieces.MANIFEST).read_text())
    assert len(manifest["pieces"]) >= 2
    assert all(p["bytes"] <= 400 for p in manifest["pieces"])
    assert sum(p["bytes"] for p in manifest["pieces"]) == manifest["archive"]["bytes"]
    for p in manifest["pieces"]:
        assert hashlib.sha256((kit / p["name"]).read_bytes()).hexdigest() == p["sha256"]
    assert vllm_pieces.verify(kit) == manifest
    with pytest.raises(KitError, match="valid: 1 .. 62914560"):
        vllm_pieces.split(tmp_path / vllm_pieces.ARCHIVE, kit, 61 * 2**20)


def test_a_missing_or_damaged_piece_is_named_in_one_line(tmp_path):
    kit = _kit(tmp_path, piece_bytes=400)
    names = [p["name"] for p in vllm_pieces.read_manifest(kit)["pieces"]]
    (kit / names[1]).unlink()
    with pytest.raises(KitError, match=rf"^piece {names[1]} missing from .*{kit.name}$"):
        vllm_pieces.verify(kit)
    data = bytearray((kit / names[0]).read_bytes())
    data[10] ^= 1
    (kit / names[0]).write_bytes(bytes(data))
    with pytest.raises(KitError, match=rf"^piece {names[0]} damaged: its sha256 differs .* \(and 1 more\)$"):
        vllm_pieces.verify(kit)
    (kit / names[0]).write_bytes(bytes(data[:-1]))
    with pytest.raises(KitError, match=rf"piece {names[0]} damaged: {len(data) - 1} bytes, the manifest says {len(data)}"):
        vllm_pieces.verify(kit)
    (kit / vllm_pieces.MANIFEST).unlink()
    with pytest.raises(KitError, match="no manifest"):
        vllm_pieces.verify(kit)


def test_pieces_stashed_one_transfer_at_a_time_assemble_and_install_offline(tmp_path):
    kit = _kit(tmp_path, piece_bytes=400)
    home = tmp_path / "home"
    names = [p["name"] for p in vllm_pieces.read_manifest(kit)["pieces"]]
    for i, name in enumerate(names):  # each transfer carries the manifest and one piece
        carried = tmp_path / f"transfer{i}"
        carried.mkdir()
        (carried / vllm_pieces.MANIFEST).write_bytes((kit / vllm_pieces.MANIFEST).read_bytes())
        (carried / name).write_bytes((kit / name).read_bytes())
        assert vllm_pieces.stash(carried, home) == [name]
        if i == 0:
            with pytest.raises(KitError, match=f"piece {names[1]} missing"):
                vllm_pieces.install(home)
    target = tmp_path / "site"
    printed = vllm_pieces.install(home, target=target)
    assert printed.startswith(f"vllm {vllm_kit.VLLM_VERSION} from {target}")
    assert not (target / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so").exists()
    assert not (target / "vllm" / "vllm_flash_attn" / "cute").exists()  # FA4 reads as unavailable
    assert (target / "vllm" / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").is_file()


def test_a_damaged_transfer_is_refused_when_it_is_stashed(tmp_path):
    kit = _kit(tmp_path, piece_bytes=400)
    name = vllm_pieces.read_manifest(kit)["pieces"][0]["name"]
    (kit / name).write_bytes(b"short")
    r = subprocess.run([sys.executable, "-m", "verl_hpc.gpu_check.vllm_pieces", "stash", str(kit),
                        "--home", str(tmp_path / "home")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip() == f"vllm kit: piece {name} damaged: 5 bytes, the manifest says " \
                               f"{vllm_pieces.read_manifest(kit)['pieces'][0]['bytes']}"
    assert not (tmp_path / "home").exists()


def test_each_transfer_is_sized_with_the_work_tree_as_it_travels(tmp_path):
    manifest = {"pieces": [{"name": "a.001", "bytes": 48 * 2**20}, {"name": "a.002", "bytes": 2**20}]}
    sizes = dict(vllm_kit.transfers(manifest, tree=7 * 10**6))
    assert sizes["a.001"] > 48 * 2**20 + 7 * 10**6 and sizes["a.002"] < sizes["a.001"]
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("/gpu_vllm_kit/\n")  # 15 bytes
    (tmp_path / "tracked.py").write_bytes(b"x" * 100)
    git("add", ".gitignore", "tracked.py")
    (tmp_path / "untracked.py").write_bytes(b"y" * 10)  # travels: not ignored
    (tmp_path / "gpu_vllm_kit").mkdir()
    (tmp_path / "gpu_vllm_kit" / "piece.001").write_bytes(b"z" * 1000)  # carried apart, not with the tree
    assert vllm_kit.tree_bytes(tmp_path) == 15 + 100 + 10


def test_a_node_whose_glibc_is_older_than_the_wheels_is_told_so():
    with pytest.raises(KitError, match="glibc 2.28 is older than the 2.31"):
        vllm_pieces.glibc_problem("2.31", "2.28")
    vllm_pieces.glibc_problem("2.31", "2.35")
    vllm_pieces.glibc_problem("2.31", "2.31")


def test_the_probe_tells_a_missing_module_from_a_missing_gpu_driver(tmp_path, monkeypatch):
    from verl_hpc.gpu_check import vllm_kit_probe

    (tmp_path / "needs_driver_mod.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    (tmp_path / "needs_other_mod.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('symbol lookup error: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems, notes = vllm_kit_probe.probe_imports(("needs_driver_mod", "needs_other_mod", "broken_mod", "json"))
    assert problems == ["needs_other_mod: missing module no_such_dependency_xyz",
                        "broken_mod: RuntimeError: symbol lookup error: _ZN3c10"]
    assert notes == ["needs_driver_mod: ImportError: libcuda.so.1: cannot open shared object file"]
