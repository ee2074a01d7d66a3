"""Where a whole `make test` spends its CPU (`make test-profile`; docs/testing.md, "Where the time goes").

The suite is bound by the machine's cores, so its time is the CPU it spends, and most of that is
spent in processes the tests start (ranks, submitters, probes), not in the pytest workers. Three
records, all under $SUITE_PROFILE_LOG:

- processes.jsonl: every Python process of the venv logs its CPU time at exit, with its argv, the
  modules it imported of torch / Megatron-Core / transformers / vLLM, and the test that started it
  (pytest's PYTEST_CURRENT_TEST reaches a test's subprocesses). `install` puts a .pth file in the
  venv that imports this module in every interpreter; it does nothing unless SUITE_PROFILE_LOG is set.
  A process killed outright (SIGKILL) logs nothing.
- tests_<worker>.jsonl: each test's CPU in its pytest worker and its wall time
  (scripts/suite_profile_plugin.py, `-p suite_profile_plugin`).
- vmstat.log: the machine's CPU every 5 s (`vmstat -n 5`), written by the Makefile's target.

`report` sums them: CPU by kind of process, by tier and by test, and the machine's idle share.
Not a pytest plugin from PyPI: none records the CPU of the processes a test starts.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time

LOG_ENV = "SUITE_PROFILE_LOG"
PTH = "zz_suite_profile.pth"
WATCHED = ("torch", "megatron.core", "transformers", "vllm")


def _log_process(folder: str, started: float) -> None:
    t = os.times()
    record = dict(pid=os.getpid(), argv=sys.argv[:6], test=os.environ.get("PYTEST_CURRENT_TEST"),
                  cpu=t.user + t.system, wall=time.time() - started, mods=[m for m in WATCHED if m in sys.modules])
    try:
        with open(os.path.join(folder, "processes.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")  # one short append per process: lines do not interleave
    except OSError:
        pass  # a process whose folder is gone (a test's sandbox) is not worth failing


if os.environ.get(LOG_ENV):
    atexit.register(_log_process, os.environ[LOG_ENV], time.time())


# ------------------------------------------------------------------------------ install, report
def install(venv_site: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(venv_site, PTH)
    with open(path, "w") as f:
        f.write(f"import sys; sys.path.insert(0, {here!r}); import suite_profile\n")
    return path


def uninstall(venv_site: str) -> None:
    path = os.path.join(venv_site, PTH)
    if os.path.exists(path):
        os.remove(path)


def _kind(record: dict) -> str:
    argv = " ".join(record["argv"])
    if record["argv"][:1] == ["-c"] and not record["test"]:  # execnet starts them with `python -c`, before any test
        return "pytest-xdist workers"
    if "verl_hpc/job.py" in argv:
        return "the product's ranks (verl_hpc/job.py)"
    if "verl_hpc/submit.py" in argv and "--local" in argv:
        return "local submitters (verl_hpc.submit --local)"
    if "/tests/" in argv and "_ranks.py" in argv:
        return "rank scripts of the dist scenarios"
    if "model_executor/models/registry.py" in argv:
        return "vLLM inspecting a model class"
    return "other (Slurm's ranks, submitit, tools, probes)"


def report(folder: str, top: int = 25) -> str:
    import collections
    import glob

    procs = [json.loads(line) for line in open(os.path.join(folder, "processes.jsonl")) if line.strip()]
    kinds = collections.defaultdict(lambda: [0, 0.0])
    per_test = collections.defaultdict(float)
    for r in procs:
        kinds[_kind(r)][0] += 1
        kinds[_kind(r)][1] += r["cpu"]
        if r["test"]:
            per_test[r["test"].rsplit(" (", 1)[0]] += r["cpu"]
    for path in glob.glob(os.path.join(folder, "tests_*.jsonl")):
        for line in open(path):
            r = json.loads(line)
            per_test[r["test"]] += r["cpu"]
    lines = [f"Python processes: {len(procs)}, {sum(r['cpu'] for r in procs) / 60:.1f} CPU-min"]
    for kind, (n, cpu) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {cpu / 60:6.1f} CPU-min  {n:4d} processes  {kind}")
    tiers = collections.Counter()
    for test, cpu in per_test.items():
        tiers[test.split("/")[1] if test.startswith("tests/") else "?"] += cpu
    lines.append("by tier (each test with what it started): "
                 + ", ".join(f"{t} {c / 60:.1f}" for t, c in tiers.most_common() if c >= 3) + " CPU-min")
    lines.append(f"the {top} tests that cost most (CPU-s, theirs and their processes'):")
    for test, cpu in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {cpu:7.1f}  {test}")
    vmstat = os.path.join(folder, "vmstat.log")
    if os.path.exists(vmstat):
        rows = [ln.split() for ln in open(vmstat) if ln.split() and ln.split()[0].isdigit()]
        if rows:  # us sy id: columns 13-15 of vmstat's default output
            mean = [sum(int(r[c]) for r in rows) / len(rows) for c in (12, 13, 14)]
            lines.append(f"machine CPU over {len(rows)} samples: {mean[0]:.0f}% user, {mean[1]:.0f}% system, "
                         f"{mean[2]:.1f}% idle")
    return "\n".join(lines)


if __name__ == "__main__":
    usage = "usage: suite_profile.py install SITE | uninstall SITE | report FOLDER"
    if len(sys.argv) != 3 or sys.argv[1] not in ("install", "uninstall", "report"):
        sys.exit(usage)
    command, arg = sys.argv[1:]
    if command == "install":
        print(f"suite_profile: {install(arg)}")
    elif command == "uninstall":
        uninstall(arg)
    else:
        print(report(arg))
