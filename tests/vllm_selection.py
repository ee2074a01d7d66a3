"""The tests that touch vLLM: the `vllm` marker, which `make test-vllm-range` selects to run on the
other verified vLLM release (docs/testing.md, "The verified vLLM range").

Given at collection, in the tiers the range covers (tests/unit, tests/jobs, tests/dist; the Slurm and
container tiers test the batch system and the image, on the main venv's vLLM):
- every test of tests/jobs and tests/dist (their jobs roll out with vLLM, the default engine), but
  those of a module marked `no_vllm` with its reason (`pytestmark = pytest.mark.no_vllm("why")`:
  parity of the training engines, checkpoint layouts);
- every test of a tests/unit module whose source names vLLM (any case: an import of vllm or of
  verl_hpc.rollout.vllm, an engine name, a docstring);
- any test marked `vllm` by hand.

Checked as the tests run, in every run: a test during which this process built a `vllm.LLM`, or a
rank it started through tests/rank_launcher.py imported vLLM (tests/vllm_seen.py notes each), fails at teardown when it is not marked `vllm`, or is marked
`no_vllm`, naming what it did. So a new test that touches vLLM cannot stay out of the range unseen:
`make test` fails it until its module is marked. (A process started otherwise, with an environment
of its own making, is not watched: such tests are in the range by their tier or their source.)
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

import vllm_seen

TESTS = Path(__file__).resolve().parent
RANGE_TIERS = ("unit", "jobs", "dist")
WHOLE_TIERS = ("jobs", "dist")  # every test but a no_vllm module's
_NAMES_VLLM = re.compile(r"vllm", re.IGNORECASE)
_sources: dict = {}


def tier(item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]


def names_vllm(path) -> bool:
    key = str(path)
    if key not in _sources:
        try:
            _sources[key] = bool(_NAMES_VLLM.search(Path(key).read_text(errors="replace")))
        except OSError:
            _sources[key] = False
    return _sources[key]


def mark(item) -> None:
    """At collection (tests/conftest.py's pytest_itemcollected): add `vllm` where the rules say."""
    if tier(item) not in RANGE_TIERS or item.get_closest_marker("vllm") is not None:
        return
    opted_out = item.get_closest_marker("no_vllm")
    if opted_out is not None:
        if not (opted_out.args and isinstance(opted_out.args[0], str) and opted_out.args[0].strip()):
            raise pytest.UsageError(f"{item.nodeid}: pytest.mark.no_vllm needs its reason, "
                                    "e.g. pytest.mark.no_vllm('training engines only: no rollout')")
        return
    if tier(item) in WHOLE_TIERS or names_vllm(item.fspath):
        item.add_marker("vllm")


def unmarked_problem(item, seen: str):
    """Why a test that touched vLLM (`seen`: the notes) fails its teardown, or None."""
    if not seen.strip():
        return None
    if item.get_closest_marker("vllm") is not None and item.get_closest_marker("no_vllm") is None:
        return None
    what = sorted({line.split(" ", 1)[1] for line in seen.splitlines() if " " in line})
    how = ("drop its module's no_vllm mark" if item.get_closest_marker("no_vllm") is not None
           else "mark its module `pytestmark = pytest.mark.vllm`")
    return (f"{item.nodeid} touched vLLM ({'; '.join(what)}) but is not marked `vllm`, so `make "
            f"test-vllm-range` would not run it on the other verified vLLM release: {how} "
            "(tests/vllm_selection.py)")


class Watch:
    """The run-time check, registered by tests/conftest.py in each pytest process."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="verl-hpc-vllm-seen-")
        vllm_seen.NOTE_IMPORTS = False  # here only engines: which test imports vLLM first is chance

    def notes_of(self, item) -> str:
        return os.path.join(self.folder, hashlib.sha1(item.nodeid.encode()).hexdigest())

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        """The test's notes file in the environment from its setup to its teardown (the processes
        it starts inherit it; rank_launcher passes it to the ranks)."""
        before = os.environ.get(vllm_seen.ENV)
        if tier(item) in RANGE_TIERS:
            os.environ[vllm_seen.ENV] = self.notes_of(item)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(vllm_seen.ENV, None)
            else:
                os.environ[vllm_seen.ENV] = before

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when != "teardown" or tier(item) not in RANGE_TIERS:
            return
        path = self.notes_of(item)
        try:
            seen = Path(path).read_text()
            os.unlink(path)
        except OSError:
            return
        problem = unmarked_problem(item, seen)
        report = outcome.get_result()
        if problem and report.outcome == "passed":
            report.outcome, report.longrepr = "failed", problem

    def pytest_unconfigure(self, config):
        shutil.rmtree(self.folder, ignore_errors=True)
