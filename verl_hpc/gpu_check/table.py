"""OUT/gpu_check.json, the table of a `python -m verl_hpc.gpu_check` run: written before and after each
check (each check's status, seconds and budget; the checks asked for; the one running now), so
that a run killed at its limit leaves what it had, and the next run can continue it (`--continue`,
which `make gpu-all` uses after such a kill: all.py).

A check is stopped at its budget from inside the process (kit.time_limit), but only where Python
runs: a hang in C (a kernel, a collective, a CUDA-graph capture) holds the process until the
step's limit kills it. Then the check that was running is recorded TIMEOUT, and a new process runs
the checks not reached, with the ones they need first (a fresh process sets its state up again):
the hang costs that one check, not the rest of the set.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

TABLE = "gpu_check.json"


def row(check, status: str, detail: str, seconds: float) -> Dict:
    return {"check": check.name, "status": status, "detail": detail, "seconds": round(seconds, 1),
            "budget_s": check.budget_s}


class TableFile:
    """The table of this run, after the rows of the run it continues (`prior`): a check run again
    here (one the others need) keeps its earlier row unless it did not pass this time."""

    def __init__(self, out: Path, planned: Sequence[str], prior: Sequence[Dict] = ()) -> None:
        self.path, self.planned, self.prior, self.rows = out / TABLE, list(planned), list(prior), []

    def started(self, check, limit: Optional[float]) -> None:
        self._write({"check": check.name, "limit_s": limit})

    def done(self, rows) -> None:
        self.rows = [row(*r) for r in rows]
        self._write(None)

    def merged(self) -> List[Dict]:
        new = {r["check"]: r for r in self.rows}
        kept = []
        for r in self.prior:
            again = new.pop(r["check"], None)
            kept.append(again if again is not None and again["status"] != "PASS" else r)
        return kept + [r for r in self.rows if r["check"] in new]

    def _write(self, running: Optional[Dict]) -> None:
        self.path.write_text(json.dumps({"planned": self.planned, "running": running, "rows": self.merged()},
                                        indent=1) + "\n")


def continuation(out: Path, checks) -> Tuple[List[Dict], List[str], List[str]]:
    """(the rows of the run killed in `out`, with the check it was running as TIMEOUT; the names of
    the checks to run now; the checks that run was asked for). Raises ValueError where `out` has no
    table to continue."""
    path = out / TABLE
    if not path.is_file():
        raise ValueError(f"--continue: {path} does not exist; valid: the --out folder of a run that was stopped")
    try:
        table = json.loads(path.read_text())
        prior = list(table["rows"])
        planned = list(table["planned"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--continue: {path} is not a gpu_check table ({e}); valid: one this command wrote")
    running = table.get("running")
    by_name = {c.name: c for c in checks}
    if running and running.get("check") in by_name:
        limit = running.get("limit_s")
        prior.append(row(by_name[running["check"]], "TIMEOUT",
                         f"killed with its run at the run's limit{f' ({limit:.0f} s)' if limit else ''}: "
                         "a hang outside Python (a kernel, a collective); the checks after it ran in a new process",
                         limit or 0.0))
    reported = {r["check"] for r in prior}
    wanted = {c.name for c in checks if c.name in planned and c.name not in reported}
    while True:  # and what they need, and what that needs
        more = {n for c in checks if c.name in wanted for n in c.needs} - wanted
        if not more:
            return prior, [c.name for c in checks if c.name in wanted], planned
        wanted |= more
