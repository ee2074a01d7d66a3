"""A rank's start-up imports (verl_hpc/launcher/startup_imports.py): the collector off while they
run, the garbage collected and the survivors frozen at the end, the collector back as it was; each
role preloads only what it builds its engines with; a rank and the submitter leave the collector on."""
import gc
import weakref
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.launcher import startup_imports
from verl_hpc.launcher.startup_imports import (FSDP, HF_MODELS, MEGATRON, TOKENIZER, VLLM, modules_for, preload,
                                               without_gc)

REPO = Path(__file__).resolve().parents[2]


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_the_collector_is_off_inside_and_its_garbage_collected_at_the_end():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with without_gc():
        assert not gc.isenabled()
        dead, kept = Node(), Node()
        gone = weakref.ref(dead)
        del dead  # garbage made while the libraries import: not frozen with the survivors
    assert gc.isenabled()
    assert gone() is None
    assert gc.get_freeze_count() > before  # the survivors (`kept` among them) out of the collector's walks
    assert kept.me is kept


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with without_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_comes_back_when_the_start_up_fails():
    with pytest.raises(RuntimeError, match="bootstrap"):
        with without_gc():
            raise RuntimeError("bootstrap failed")
    assert gc.isenabled()


@pytest.mark.parametrize("overrides,role,want,never", [
    ([], "both", TOKENIZER + MEGATRON + VLLM, []),  # colocated RL: Megatron and vLLM on every rank
    (["placement.mode=split"], "rollout", TOKENIZER + VLLM, MEGATRON),
    (["placement.mode=split"], "train", TOKENIZER + MEGATRON, VLLM),
    (["parallel.engine=fsdp", "rollout.engine=hf"], "both", TOKENIZER + FSDP, MEGATRON + VLLM),
    (["placement.mode=split", "rollout.engine=hf"], "rollout", TOKENIZER + HF_MODELS, MEGATRON + VLLM),
    (["parallel.engine=auto", "rollout.engine=auto"], "both", TOKENIZER, MEGATRON + VLLM),  # chosen later: not guessed
    (["trainer.job=dpo"], "both", TOKENIZER + MEGATRON, VLLM),  # no rollout
    (["trainer.job=smoke"], "both", [], TOKENIZER),  # no model: torch only
], ids=["colocated", "split-rollout", "split-train", "fsdp-hf", "split-rollout-hf", "auto", "dpo", "smoke"])
def test_each_role_preloads_what_it_builds_and_nothing_else(overrides, role, want, never):
    mods = modules_for(load_config(None, overrides), role)
    assert set(want) <= set(mods) and not set(never) & set(mods), mods


def test_a_preload_that_does_not_import_is_left_to_the_code_that_needs_it(monkeypatch):
    monkeypatch.setattr(startup_imports, "modules_for", lambda cfg, role: ["verl_hpc_no_such_module", "json"])
    assert preload(None, "both") == ["json"]


@pytest.mark.heavy  # a smoke job's rank in this process (tests/jobs.py): torch's process group up and down
def test_a_rank_preloads_with_the_collector_off_and_runs_its_program_with_it_on(tmp_path, monkeypatch):
    from jobs import run_here

    from verl_hpc import job
    from verl_hpc.trainer.programs import smoke

    seen = {}
    monkeypatch.setattr(job, "preload", lambda cfg, role: seen.update(preload=(role, gc.isenabled())))
    real = smoke.run
    monkeypatch.setattr(smoke, "run", lambda cfg, ctx: seen.update(program=gc.isenabled()) or real(cfg, ctx))
    proc, _ = run_here("configs/smoke.yaml", tmp_path / "out", "trainer.smoke.steps=1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert seen == {"preload": ("both", False), "program": True}
    assert gc.isenabled()


def test_the_submitter_leaves_the_collector_on(tmp_path, monkeypatch, capsys):
    from verl_hpc import submit

    monkeypatch.chdir(REPO)
    assert submit.main(["configs/smoke.yaml", "--dry-run", "--local", f"trainer.output_dir={tmp_path}/out"]) == 0
    assert gc.isenabled()


def test_the_benchmark_times_both_variants(monkeypatch, capsys):
    """benchmarks/bench_startup.py's two interpreters, on a cheap import: each variant runs, the
    off one inside without_gc, and the ratio is printed."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_startup

    # the child fails (and main with it) unless the collector is off exactly in the variant run inside without_gc
    monkeypatch.setattr(bench_startup, "IMPORTS", "import json, gc; assert gc.isenabled() != ('without_gc' in dir())")
    assert bench_startup.main(["--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "round 1/1: collector on" in out and "x the CPU" in out, out
