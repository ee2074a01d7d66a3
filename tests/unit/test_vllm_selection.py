"""The `vllm` marker (tests/vllm_selection.py), which `make test-vllm-range` selects: given by the rules,
and a test that touches vLLM without it fails, in this process or in a process it starts. Run on a
small suite of its own, against a stand-in `vllm` package (an `LLM` class that builds nothing)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import rank_launcher
import vllm_seen
import vllm_selection

TESTS = Path(vllm_selection.__file__).resolve().parent

FAKE_VLLM = {"vllm/__init__.py": "",
             "vllm/entrypoints/__init__.py": "",
             "vllm/entrypoints/llm.py": "class LLM:\n    def __init__(self, model=None):\n        self.model = model\n"}
# a helper that builds an engine, so that the test modules calling it do not name vLLM themselves
HELPER = "def build():\n    from " + "vl" + "lm.entrypoints.llm import LLM\n    return LLM('m')\n"
SUITE = {
    "unit/test_named.py": "def test_builds():\n    from vllm.entrypoints.llm import LLM\n    LLM()\n",
    "unit/test_hidden.py": "import helper\n\ndef test_builds():\n    helper.build()\n\ndef test_plain():\n    pass\n",
    "unit/test_marked.py": "import helper\nimport pytest\n\npytestmark = pytest.mark.vllm\n\n"
                           "def test_builds():\n    helper.build()\n",
    "jobs/test_job.py": "def test_a_job():\n    pass\n",
    "jobs/test_opted_out.py": "import helper\nimport pytest\n\npytestmark = pytest.mark.no_vllm('no rollout')\n\n"
                              "def test_builds_anyway():\n    helper.build()\n\ndef test_plain():\n    pass\n",
    "dist/test_ranks.py": "import os, subprocess, sys\nimport pytest\n\n"
                          "pytestmark = pytest.mark.no_vllm('training engines only')\n\n"
                          "def test_a_child_imports_it():\n"
                          "    subprocess.run([sys.executable, '-c', 'import vllm_seen, ' + 'vl' + 'lm'], check=True)\n",
    "slurm/test_cluster.py": "import helper\n\ndef test_builds():\n    helper.build()\n",
}


def _suite(root: Path, files: dict) -> Path:
    for rel, text in {**FAKE_VLLM, **files, "helper.py": HELPER}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider --strict-markers\n"
                                     "norecursedirs = .*\nmarkers =\n"  # dist/ is collected, as in ours
                                     "    vllm: touches vLLM\n    no_vllm(reason): touches none\n")
    (root / "conftest.py").write_text(textwrap.dedent(f"""
        import pathlib
        import sys
        sys.path[:0] = [{str(TESTS)!r}, {str(root)!r}]
        import vllm_selection
        vllm_selection.TESTS = pathlib.Path(__file__).resolve().parent
        def pytest_itemcollected(item):
            vllm_selection.mark(item)
        def pytest_configure(config):
            config.pluginmanager.register(vllm_selection.Watch(), "vllm_selection")
        """))
    return root


def _pytest(root: Path, *args):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{TESTS}:{root}", "HOME": str(root)}
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_rules_mark_what_the_range_runs(tmp_path):
    root = _suite(tmp_path, SUITE)
    r = _pytest(root, "--collect-only", "-q", "-m", "vllm")
    selected = sorted(line for line in r.stdout.splitlines() if "::" in line)
    assert selected == ["jobs/test_job.py::test_a_job", "unit/test_marked.py::test_builds",
                        "unit/test_named.py::test_builds"], r.stdout + r.stderr


def test_a_test_that_touches_vllm_unmarked_fails_naming_what_it_did(tmp_path):
    root = _suite(tmp_path, SUITE)
    r = _pytest(root, "-rA")
    outcomes = {line.split(" ", 2)[1]: line.split(" ", 1)[0] for line in r.stdout.splitlines()
                if line.startswith(("PASSED ", "FAILED ", "ERROR "))}
    assert outcomes == {
        "unit/test_named.py::test_builds": "PASSED",  # its source names vLLM
        "unit/test_hidden.py::test_builds": "ERROR",  # builds an engine through a helper, unmarked
        "unit/test_hidden.py::test_plain": "PASSED",
        "unit/test_marked.py::test_builds": "PASSED",
        "jobs/test_job.py::test_a_job": "PASSED",
        "jobs/test_opted_out.py::test_builds_anyway": "ERROR",  # no_vllm, yet it built one
        "jobs/test_opted_out.py::test_plain": "PASSED",
        "dist/test_ranks.py::test_a_child_imports_it": "ERROR",  # a process it started imported vLLM
        "slurm/test_cluster.py::test_builds": "PASSED",  # outside the range's tiers: not watched
    }, r.stdout + r.stderr
    assert ("unit/test_hidden.py::test_builds touched vLLM (built a vllm.LLM engine) but is not marked `vllm`, "
            "so `make test-vllm-range` would not run it on the other verified vLLM release: mark its module "
            "`pytestmark = pytest.mark.vllm`") in r.stdout
    assert "jobs/test_opted_out.py::test_builds_anyway touched vLLM (built a vllm.LLM engine)" in r.stdout
    assert "drop its module's no_vllm mark" in r.stdout
    assert "dist/test_ranks.py::test_a_child_imports_it touched vLLM (imported vllm)" in r.stdout


def test_no_vllm_without_its_reason_is_refused(tmp_path):
    root = _suite(tmp_path, {"jobs/test_bare.py": "import pytest\n\npytestmark = pytest.mark.no_vllm\n\n"
                                                  "def test_it():\n    pass\n"})
    r = _pytest(root, "--collect-only", "-q")
    assert r.returncode != 0 and "jobs/test_bare.py::test_it: pytest.mark.no_vllm needs its reason" in r.stdout + r.stderr


def test_the_ranks_the_tests_start_carry_the_notes():
    """tests/rank_launcher.py passes the running test's notes file to its ranks and preloads the hook
    in its fork server (before the heap is frozen), so a forked rank's vLLM is noted."""
    import os

    assert "vllm_seen" in rank_launcher.PRELOAD and rank_launcher.PRELOAD[-1] == "heap_frozen"
    assert rank_launcher._rank_env(0, 1, 1, "INFO")[vllm_seen.ENV] == os.environ[vllm_seen.ENV]
    assert os.environ[vllm_seen.ENV].startswith(vllm_selection.tempfile.gettempdir())
