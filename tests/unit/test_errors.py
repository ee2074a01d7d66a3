"""Every error written for a user derives from verl_hpc.errors.VerlHpcError, carries its own exit
code, and is listed with that code in docs/errors.md; `report` reads the code from the class."""
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import verl_hpc
from verl_hpc.errors import VerlHpcError
from verl_hpc.runtime.errors import exit_code_for, report

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
# Internal signals, caught where they are raised and never shown to a user as such: the reward
# scorer turns a timeout or an exiting function into a score or a RewardError; gpu_check prints a
# check it cannot run as NOT TESTABLE; the tool pool turns a failed tool into the model's observation;
# the environment responder turns a step's return that is not a triple into a ConfigError; an
# elastic rollout worker's Leaving ends its loop with a goodbye and exit 0.
INTERNAL = {"verl_hpc.trainer.placement.elastic.worker.Leaving","verl_hpc.rewards.timeout.RewardTimeout", "verl_hpc.rewards.timeout.FunctionExited",
            "verl_hpc.gpu_check.kit.NotTestable",
            # the vLLM kit's piece check runs before verl_hpc's dependencies are installed, so it
            # imports nothing of verl_hpc; its main prints the one line and exits 1
            "verl_hpc.gpu_check.vllm_pieces.KitError", "verl_hpc.rollout.tools.calls.ToolFailed",
            "verl_hpc.rollout.tools.environment._BadReturn",
            # the agent endpoint's: answered to the agent as HTTP error bodies, never raised to a user
            "verl_hpc.rollout.agents.chat.BadRequest", "verl_hpc.rollout.agents.batcher.EngineClosed",
            "verl_hpc.rollout.agents.batcher.EngineRequestError",
            # engine faults the recovery rebuilds from (rollout/recovery.py); past its bounds the job
            # reports RolloutEngineError or StageStalledError
            "verl_hpc.rollout.recovery.EngineStalled", "verl_hpc.runtime.faults.InjectedFault",
            # a GPU check past its budget: a TIMEOUT row of the kit's table (gpu_check/kit.py)
            "verl_hpc.gpu_check.kit.CheckTimeout"}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _project_classes(base):
    for m in pkgutil.walk_packages(verl_hpc.__path__, "verl_hpc."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
    return sorted({c for c in _subclasses(base) if c.__module__.startswith("verl_hpc.")},
                  key=lambda c: (getattr(c, "exit_code", 0), c.__name__))


def _doc_codes():
    """class name -> the exit code of the docs/errors.md table row that names it."""
    codes = {}
    for line in DOC.read_text().splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|(.*)", line)
        if row:
            for name in re.findall(r"`(\w+)`", row.group(2).split("|")[0]):
                codes[name] = int(row.group(1))
    return codes


def test_every_error_class_has_its_own_code_and_is_documented():
    classes = _project_classes(VerlHpcError)
    assert len(classes) >= 12
    declared = {}
    for cls in classes:
        assert "exit_code" in vars(cls), f"{cls.__name__} declares no exit code of its own"
        assert cls.exit_code not in declared, f"{cls.__name__} and {declared.get(cls.exit_code)} share {cls.exit_code}"
        declared[cls.exit_code] = cls.__name__
        assert cls.exit_code not in (0, 1), cls  # 1 is "unknown error, with its traceback"
        assert cls.kind != VerlHpcError.kind, cls
    doc = _doc_codes()
    wrong = {c.__name__: (c.exit_code, doc.get(c.__name__)) for c in classes if doc.get(c.__name__) != c.exit_code}
    assert not wrong, f"docs/errors.md disagrees with the classes (class: (code, documented)): {wrong}"


def test_every_project_exception_is_a_known_error_or_an_internal_signal():
    loose = {f"{c.__module__}.{c.__name__}" for c in _project_classes(BaseException)
             if not issubclass(c, VerlHpcError)}
    assert loose == INTERNAL


def test_report_prints_one_line_and_returns_the_class_code(capsys):
    from verl_hpc.trainer.hooks.rollback import RollbackError

    assert report(RollbackError("rollback guard: nothing to roll back to\n  - step 3"), rank=2) == 18
    assert capsys.readouterr().err == "error: rank 2: rollback guard: nothing to roll back to; step 3\n"
    assert report(KeyError("x"), rank=0) is None and exit_code_for(ValueError()) is None


def test_builtin_bases_are_kept():
    # callers that catch the builtin keep working
    from verl_hpc.checkpoint.errors import CheckpointNotFoundError
    from verl_hpc.rollout.prompts import PromptTooLongError
    from verl_hpc.runtime.collectives import CollectiveError

    assert issubclass(PromptTooLongError, ValueError) and issubclass(CollectiveError, RuntimeError)
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    assert PromptTooLongError.exit_code == 17 and CheckpointNotFoundError.exit_code == 21
