"""The kits over the GPU node's image (verl_hpc/gpu_check/image.py): a resolution against a list of
the image's packages carries none that the image serves, the one-command flow installs into a
prefix of its own and runs every step with that prefix's Python, and the image's site-packages is
left as it was (a CPU rehearsal with tiny local wheels, this venv standing for the image)."""
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from verl_hpc.gpu_check import all as gpu_all
from verl_hpc.gpu_check import image, vllm_kit, wheels

pytestmark = pytest.mark.unit


def item(name, version, *requires, extras=()):
    """One entry of pip's --report `install` list."""
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires),
                         "provides_extra": list(extras)}}


IMAGE = {"numpy": "2.5.2", "pillow": "12.0.0", "aiohttp": "3.13.0", "pydantic": "2.10.0",
         "torch": "2.11.0+cu130", "typing-extensions": "4.15.0", "uvloop": "0.21.0"}


def test_the_image_serves_what_it_has_at_a_version_every_requirement_accepts():
    items = [item("vllm", "0.25.0", "torch==2.11.0", "pydantic>=2.12", "numpy", "pillow",
                  "uvloop; sys_platform == 'win32'", "openai[extra-one]>=2"),
             item("openai", "2.1.0", "typing-extensions>=4.11", "aiohttp<3.13; extra == 'extra-one'",
                  "numpy<2; extra == 'never-asked'", extras=("extra-one", "never-asked")),
             item("torch", "2.11.0"), item("pydantic", "2.12.5"), item("numpy", "2.4.6"), item("pillow", "12.0.0"),
             item("typing-extensions", "4.16.0"), item("aiohttp", "3.12.0"), item("uvloop", "0.21.0")]
    served = image.served(items, IMAGE, ["vllm==0.25.0"], "3.12")
    # pydantic: too old for vLLM; aiohttp: openai's asked extra wants < 3.13; numpy's < 2 is an extra
    # nobody asks for; uvloop's requirement holds on Windows only, but the image's has no other bound
    assert served == {"torch": "2.11.0+cu130", "numpy": "2.5.2", "pillow": "12.0.0", "typing-extensions": "4.15.0",
                      "uvloop": "0.21.0"}
    assert image.constraint("2.11.0+cu130") == "2.11.0"


def fake_resolver(calls, conflicting=None):
    """pip `install --dry-run --report` as the builders call it: vLLM's needs at the index's newest
    versions, or at the constraint file's; a constraint of `conflicting` ({name: version}) is
    refused the way pip explains a conflict."""
    newest = {"vllm": "0.25.0", "numpy": "2.4.6", "pillow": "11.3.0", "aiohttp": "3.12.15", "openai": "2.1.0",
              "pydantic": "2.12.5", "typing-extensions": "4.16.0", "torch": "2.11.0", "nvidia-nccl": "2.29.0"}

    def pip(*args, capture=False):
        pinned = {}
        if "-c" in args:
            for line in Path(args[args.index("-c") + 1]).read_text().split():
                name, ver = line.split("==")
                pinned[name] = ver
        calls.append(pinned)
        bad = sorted(n for n, v in (conflicting or {}).items() if pinned.get(n) == v)
        if bad:
            return subprocess.CompletedProcess(args, 1, "", "ERROR: Cannot install vllm\n\nThe conflict is caused by:\n"
                                               f"    The user requested (constraint) {bad[0]}=={pinned[bad[0]]}\n"
                                               "\nTo fix this you could try to:\nERROR: ResolutionImpossible\n")
        versions = {**newest, **pinned}
        report = {"install": [item("vllm", "0.25.0", "numpy>=2", "pillow", "aiohttp>=3.10", "openai>=2",
                                   "pydantic>=2.12", "torch==2.11.0")]
                  + [item(n, v, *{"pydantic": ["typing-extensions>=4.14"], "torch": ["nvidia-nccl"]}.get(n, [])) for n, v in versions.items()
                     if n != "vllm"]}
        Path(args[args.index("--report") + 1]).write_text(json.dumps(report))
        return subprocess.CompletedProcess(args, 0, "", "")
    return pip


def test_a_resolution_against_the_images_list_carries_none_of_what_it_serves(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(wheels, "_pip", fake_resolver(calls))
    versions, served = wheels.resolve_against(["vllm==0.25.0"], "3.12", "2.31", tmp_path, IMAGE)
    assert served == {"numpy": "2.5.2", "pillow": "12.0.0", "aiohttp": "3.13.0", "torch": "2.11.0+cu130",
                      "typing-extensions": "4.15.0"}
    # pip resolved again holding the image's versions (torch's local label is the image's own) and
    # the rest at what it had just resolved: one candidate each, nothing to backtrack through; what
    # a held package requires (torch's CUDA libraries) follows the image's version: left to pip
    assert calls[1] == {"aiohttp": "3.13.0", "numpy": "2.5.2", "pillow": "12.0.0", "torch": "2.11.0",
                        "typing-extensions": "4.15.0", "vllm": "0.25.0", "openai": "2.1.0", "pydantic": "2.12.5"}
    assert len(calls) == 2  # the second resolution served no more: done
    carried = wheels.carried_pins(versions, served)
    assert carried == {"vllm": "0.25.0", "openai": "2.1.0", "pydantic": "2.12.5", "nvidia-nccl": "2.29.0"}
    assert not set(carried) & {n for n, v in IMAGE.items() if n in served}
    # the vLLM kit: neither the image's nor the kit folder's (same version) are carried
    assert vllm_kit.carried_pins(versions, {"openai": "2.1.0", "nvidia-nccl": "2.29.0"}, served) == {
        "vllm": "0.25.0", "pydantic": "2.12.5"}
    # without the list: all but torch's install, typing-extensions always (the old rule)
    versions, served = wheels.resolve_against(["vllm==0.25.0"], "3.12", "2.31", tmp_path, None)
    assert served == {} and vllm_kit.carried_pins(versions, {}) == {"vllm": "0.25.0", "numpy": "2.4.6", "pillow": "11.3.0",
                                                   "aiohttp": "3.12.15", "openai": "2.1.0", "pydantic": "2.12.5",
                                                   "typing-extensions": "4.16.0"}


def test_an_image_version_pip_cannot_hold_is_carried_and_another_pin_in_the_way_is_freed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(wheels, "_pip", fake_resolver(calls, conflicting={"aiohttp": "3.13.0"}))
    versions, served = wheels.resolve_against(["vllm==0.25.0"], "3.12", "2.31", tmp_path, IMAGE)
    assert "aiohttp" not in served and versions["aiohttp"] == "3.12.15" and calls[-1]["aiohttp"] == "3.12.15"
    assert served["numpy"] == "2.5.2" and "aiohttp" in wheels.carried_pins(versions, served)
    calls.clear()
    monkeypatch.setattr(wheels, "_pip", fake_resolver(calls, conflicting={"openai": "2.1.0"}))  # not an image package
    versions, served = wheels.resolve_against(["vllm==0.25.0"], "3.12", "2.31", tmp_path, IMAGE)
    assert "openai" in calls[1] and "openai" not in calls[2]  # left to pip the second time
    assert served["aiohttp"] == "3.13.0" and versions["openai"] == "2.1.0"


def test_an_image_version_for_a_newer_python_than_the_builders_is_carried_with_pip_23(tmp_path, monkeypatch):
    """pip 23's dry run checks Requires-Python against the interpreter running it (3.11 here), not
    the target's 3.12: the image's numpy, if it needs 3.12, is refused as a conflict, not fatal."""
    calls = []
    resolver = fake_resolver(calls)

    def pip(*args, capture=False):
        if "-c" in args and "numpy==2.5.2" in Path(args[args.index("-c") + 1]).read_text():
            calls.append("numpy refused")
            return subprocess.CompletedProcess(args, 1, "", "ERROR: Package 'numpy' requires a different Python: "
                                                            "3.11.7 not in '>=3.12'\n")
        return resolver(*args, capture=capture)

    monkeypatch.setattr(wheels, "_pip", pip)
    versions, served = wheels.resolve_against(["vllm==0.25.0"], "3.12", "2.31", tmp_path, IMAGE)
    assert "numpy refused" in calls and "numpy" not in served and versions["numpy"] == "2.4.6"
    assert served["pillow"] == "12.0.0"


def test_the_wheel_folder_built_over_the_image_pins_none_of_its_packages(tmp_path, monkeypatch):
    resolver = fake_resolver([])

    def pip(*args, capture=False):
        if args[0] == "download":
            dest = Path(args[args.index("--dest") + 1])
            for pin in (a for a in args if "==" in a):
                (dest / "{}-{}-py3-none-any.whl".format(*pin.split("=="))).write_bytes(b"w")
            return subprocess.CompletedProcess(args, 0, "", "")
        return resolver(*args, capture=capture)

    monkeypatch.setattr(wheels, "_pip", pip)
    listed = tmp_path / "image_packages.txt"
    listed.write_text("".join(f"{n}=={v}\n" for n, v in IMAGE.items()) + "# pip list --format=freeze\n")
    assert wheels.main([str(tmp_path / "w"), "--python-version", "3.12", "--image", str(listed),
                        "--requirement", "vllm==0.25.0"]) == 0
    pins = (tmp_path / "w" / "requirements.txt").read_text().split()
    assert pins == ["nvidia-nccl==2.29.0", "openai==2.1.0", "pydantic==2.12.5", "vllm==0.25.0"]  # the list lacks nccl
    assert "over the image's packages: aiohttp==3.13.0" in (tmp_path / "w" / "TARGET").read_text()


def test_gpu_all_installs_into_the_prefix_and_runs_every_step_with_its_python(tmp_path, capsys):
    prefix = tmp_path / "env"
    assert gpu_all.main(["--dry-run", "--out", str(tmp_path / "o"), "--wheels", str(tmp_path / "w"),
                         "--vllm-kit", str(tmp_path / "k"), "--prefix", str(prefix)]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    py = str(prefix / "bin" / "python")
    assert f"{py} -m pip install --no-index --find-links {tmp_path / 'w'} -r {tmp_path / 'w' / 'requirements.txt'}" \
        in lines["install"]
    assert f"{py} -m verl_hpc.gpu_check.vllm_pieces install {tmp_path / 'k'}" in lines["vllm_install"]
    ran = [ln for ln in lines.values() if "skipped:" not in ln]
    assert len(ran) >= 5 and all(f" {py} " in ln for ln in ran), ran
    assert not prefix.exists()  # a dry run makes nothing



def test_the_prefix_is_the_one_named_or_the_default_once_a_kit_goes_in(tmp_path, monkeypatch):
    monkeypatch.setattr(image, "PREFIX", tmp_path / "default")
    assert image.chosen(tmp_path / "named", installing=False, off=False) == tmp_path / "named"
    assert image.chosen(None, installing=True, off=False) == tmp_path / "default"  # where a kit is installed
    assert image.chosen(None, installing=False, off=False) is None  # nothing installed, none made: this Python
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert image.chosen(None, installing=False, off=False) == tmp_path / "default"  # a later transfer's run
    assert image.chosen(tmp_path / "named", installing=True, off=True) is None  # --no-prefix


def tiny_wheel(folder: Path, name: str, version: str, source: str) -> Path:
    files = {f"{name}/__init__.py": source.encode(),
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={hashlib.sha256(d).hexdigest()},{len(d)}\n" for n, d in files.items())
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{name}-{version}.dist-info/RECORD", record + f"{name}-{version}.dist-info/RECORD,,\n")
    return path


def snapshot(sites):
    return {d: sorted((p.name, p.stat().st_mtime_ns) for p in Path(d).iterdir()) for d in sites}


@pytest.mark.heavy  # makes a venv and runs pip in it
def test_the_prefix_installs_over_the_image_and_leaves_the_images_site_packages_as_it_was(tmp_path, capfd):
    sites = json.loads(subprocess.run([sys.executable, "-c", image.SITES_CODE], capture_output=True, text=True,
                                      check=True).stdout)
    before = snapshot(sites)
    found = tmp_path / "wheels"
    found.mkdir()
    tiny_wheel(found, "verl_hpc_tiny_probe", "1.0", "HERE = 'prefix'\n")
    tiny_wheel(found, "iniconfig", "0.0.1", "SHADOW = True\n")  # a package the image (this venv) has
    out = tmp_path / "out"
    py = image.make_prefix(tmp_path / "env", record=out / image.LIST)
    assert image.make_prefix(tmp_path / "env") == py  # made once, reused
    listed = image.read_list(out / image.LIST)  # the image's packages, recorded before any install
    assert "pytest" in listed and "iniconfig" in listed and "verl-hpc-tiny-probe" not in listed
    r = subprocess.run([py, "-m", "pip", "install", "--no-index", "--find-links", str(found), "-q",
                        "verl_hpc_tiny_probe==1.0", "iniconfig==0.0.1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    probe = "import iniconfig, packaging, verl_hpc_tiny_probe; print(getattr(iniconfig, 'SHADOW', False), verl_hpc_tiny_probe.HERE)"
    assert subprocess.run([py, "-c", probe], capture_output=True, text=True).stdout.split() == ["True", "prefix"]
    assert snapshot(sites) == before  # not one file of the image's site-packages added, removed or rewritten
    assert subprocess.run([sys.executable, "-c", "import verl_hpc_tiny_probe"], capture_output=True).returncode == 1
    # a command relaunched in the prefix sees its packages over the image's
    capfd.readouterr()
    assert image.relaunch(tmp_path / "env", out, "verl_hpc.gpu_check.image", ["list"]) == 0
    seen = capfd.readouterr().out
    assert "verl-hpc-tiny-probe==1.0" in seen and "iniconfig==0.0.1" in seen and "pytest==" in seen


def test_a_prefix_that_cannot_be_made_stops_gpu_all_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("a plain file\n")
    assert gpu_all.main(["--out", str(tmp_path / "o"), "--wheels", str(tmp_path / "w"),
                         "--prefix", str(tmp_path / "file" / "env")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpu-all: {tmp_path / 'file' / 'env'}: cannot make the prefix there (") and err.count("\n") == 1
    assert "pytest==" in (tmp_path / "o" / image.LIST).read_text()  # the image's list, recorded first
