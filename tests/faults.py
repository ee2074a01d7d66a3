"""Faults the tests inject into a job: a reward collapse, a rollout engine that disagrees with the
trainer by a known shift, Slurm's warning signal after a chosen step, a slow rollout, a rollout
engine that serves other weights than it was sent. The product
has no setting for any of them: each fault wraps one product function, from here.

    with faults.injected(regression_at_steps=[4]):                # a job in this process (run_here)
        run_here(...)
    run_job(..., env=faults.env(warning_signal_at_step=3))        # a job in subprocesses (run_job)

In this process `injected` wraps the functions and puts them back at the block's end.

A job in subprocesses gets `env()`: this environment with the faults as JSON in VERL_HPC_TEST_FAULTS
and tests/faults_site first on PYTHONPATH. Every Python process started with it (the submitter, and
the ranks the local launcher spawns, which inherit its environment) runs faults_site/sitecustomize.py
at start-up, which loads this file and calls `install_from_env`: an import hook that wraps each
fault's function right after its module is imported. Nothing of the project or torch is imported
before that (a rank keeps signals from its first line, before torch: launcher/early_signals.py), so
this module imports the standard library only at its top.

A fault's module or function that is gone fails the test loudly: the wrap raises where it is made
(in a rank: the import of that module fails).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import signal
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Dict, Iterator, List

ENV = "VERL_HPC_TEST_FAULTS"
SITE = Path(__file__).resolve().parent / "faults_site"  # holds sitecustomize.py only


def _wrap(owner, name: str, make: Callable) -> Callable[[], None]:
    """owner.name := make(owner.name); returns what puts the original back."""
    original = vars(owner)[name]  # defined there, not inherited: putting it back restores the class
    setattr(owner, name, functools.wraps(original)(make(original)))
    return lambda: setattr(owner, name, original)


# ------------------------------------------------------------------------------ the faults
def regression_at_steps(sampling, steps: List[int]):
    """Every score of each listed RL step's first generation round := -1, and its reward/score/*
    metrics with them: a reward collapse the rollback guard must catch. Once per listed step and
    sampler, so the steps run again after a rollback are healthy."""
    import torch

    left = weakref.WeakKeyDictionary()  # StepSampler -> the listed steps it has not collapsed yet

    def make(score):
        def _score(self, step, round_, batch):
            scores, m_reward = score(self, step, round_, batch)
            pending = left.setdefault(self, set(steps))
            if round_ != 0 or step not in pending:
                return scores, m_reward
            pending.discard(step)
            m_reward = {k: (-1.0 if k.startswith("reward/score/") else v) for k, v in m_reward.items()}
            return torch.full_like(scores, -1.0), m_reward
        return _score

    return _wrap(sampling.StepSampler, "_score", make)


SHIFT_WHY = "test fault rollout_logprob_shift (tests/faults.py)"


def rollout_logprob_shift(correction, shift: float):
    """The rollout's log-probs := the actor's old log-probs - shift on the response tokens (a rollout
    engine that agrees with the trainer up to `shift`), replaced before the mismatch correction.
    The old log-probs must come from the separate forward: the step's path is forced to it, and a
    run that takes them from the rollout (bypass_mode, async_training.objective=behaviour) is
    refused."""
    import torch

    def make_path(old_log_prob_path):
        def path(cfg, batch, has_ref):
            p, why = old_log_prob_path(cfg, batch, has_ref)
            if p == "bypass":
                raise RuntimeError(f"{SHIFT_WHY} needs the old-log-prob forward; this run takes the rollout's "
                                   f"log-probs as the old policy ({why})")
            return "forward", SHIFT_WHY if p == "update" else f"{why}, {SHIFT_WHY}"
        return path

    def make_apply(apply):
        def shifted(cfg, batch):
            old = batch.old_log_probs
            batch.rollout_log_probs = torch.where(batch.mask > 0, old - float(shift), torch.zeros_like(old))
            return apply(cfg, batch)
        return shifted

    undo = [_wrap(correction, "old_log_prob_path", make_path), _wrap(correction, "apply", make_apply)]
    return lambda: [u() for u in undo]


def warning_signal_at_step(rl, at: int):
    """After RL step `at` (0: never; steps count from 1) the training rank sends itself Slurm's
    warning signal: a preemption at a chosen moment."""
    from verl_hpc.runtime.signals import WARNING_SIGNAL  # rl imports it: loaded already

    def make(checked_step):
        def signalled(self, step, timer):
            metrics = checked_step(self, step, timer)
            if step == at:
                signal.raise_signal(WARNING_SIGNAL)
            return metrics
        return signalled

    return _wrap(rl.RLTrainer, "checked_step", make)


HOLD_S = 300  # the longest either side of the mid-generation preemption waits for the other


def warning_signal_mid_generation(rl, spec: Dict):
    """{"at": step, "dir": folder}: after RL step `at` the training rank asks the rollout rank to
    hold mid-batch (`<dir>/preempt`), waits until it does (`<dir>/held`), then sends itself Slurm's
    warning signal: a preemption that finds sequences half-generated by construction, whatever the
    machine's speed or load (rollout_holds_mid_batch is the other half)."""
    from verl_hpc.runtime.signals import WARNING_SIGNAL  # rl imports it: loaded already

    at, folder = int(spec["at"]), Path(spec["dir"])

    def make(checked_step):
        def signalled(self, step, timer):
            metrics = checked_step(self, step, timer)
            if step == at:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "preempt").touch()
                end = time.monotonic() + HOLD_S
                while not (folder / "held").exists() and time.monotonic() < end:
                    time.sleep(0.05)
                (folder / "preempt").unlink()
                signal.raise_signal(WARNING_SIGNAL)
            return metrics
        return signalled

    return _wrap(rl.RLTrainer, "checked_step", make)


def rollout_holds_mid_batch(rollout_worker, folder: str):
    """Split placement's rollout leader, once the trainer asks (`<folder>/preempt`: see
    warning_signal_mid_generation), stops after the next chunk that leaves its batch unfinished
    with tokens generated, says so (`<folder>/held`) and waits there for the trainer's pause (or
    stop), so that the checkpoint takes the half-generated sequences."""
    folder = Path(folder)

    def make(extend):
        def _extend(self, b):
            result = extend(self, b)
            partial = not b.done and b.prefix_length() > 0
            if self.leader and partial and (folder / "preempt").exists() and not (folder / "held").exists():
                (folder / "held").touch()
                (folder / "was_held").touch()  # stays: the test checks that the hold happened
                end = time.monotonic() + HOLD_S
                while not (self.mb.has(f"ctl/pause/{self.pauses}") or self.mb.has(rollout_worker.STOP)) \
                        and time.monotonic() < end:
                    time.sleep(0.05)
                (folder / "held").unlink()
            return result
        return _extend

    return _wrap(rollout_worker.RolloutWorker, "_extend", make)


def rollout_chunk_delay_s(rollout_worker, seconds: float):
    """Split placement's rollout ranks pause this long after each generation chunk (inside its timed
    generation): a rollout slower than training, as on GPUs, so a preemption finds sequences
    half-generated."""
    def make(extend):
        def _extend(self, b):
            result = extend(self, b)
            time.sleep(seconds)
            return result
        return _extend

    return _wrap(rollout_worker.RolloutWorker, "_extend", make)


def rollout_group_delay_s(rollout_worker, seconds: float):
    """Elastic split placement: the run's own rollout ranks pause this long after each prompt group
    they generate: a rollout slow enough that workers joining mid-run have work."""
    def make(generate):
        def _generate_group(self, p):
            samples = generate(self, p)
            time.sleep(seconds)
            return samples
        return _generate_group

    return _wrap(rollout_worker.RolloutWorker, "_generate_group", make)


def elastic_worker_group_delay_s(worker, seconds: float):
    """An elastic rollout worker pauses this long after each prompt group it generates (a slow
    worker, or with a long pause a straggler whose groups are re-dispatched)."""
    def make(generate):
        def _generate(self, rollout, p):
            samples = generate(self, rollout, p)
            time.sleep(seconds)
            return samples
        return _generate

    return _wrap(worker.Worker, "_generate", make)


def elastic_worker_stalls_in_fetch(channel, on: bool):
    """An elastic rollout worker stops in its first weight fetch, after its pair request and before
    its side of the pair (says so on stderr, then waits): the test SIGKILLs it there."""
    def make(pair_group):
        def _pair_group(store, worker, epoch, rank, timeout_s):
            if on and rank == 1:
                print(f"test fault: worker {worker} stalls in its weight fetch", file=sys.stderr, flush=True)
                time.sleep(3600)
            return pair_group(store, worker, epoch, rank, timeout_s)
        return _pair_group

    return _wrap(channel, "pair_group", make)


def rollout_serves_other_values(vllm_engine, spec: str):
    """The vLLM rollout loads tensor NAME with other values than the weight sync handed it (its
    first row negated, after the sync recorded what it sent): a load that serves something else.
    spec: "NAME", from the first load on, or "NAME@K", from the K-th load on."""
    name, _, first = spec.partition("@")
    loads = weakref.WeakKeyDictionary()  # engine -> its loads so far

    def make(load_weights):
        def _load_weights(self, weights):
            loads[self] = loads.get(self, 0) + 1
            on = loads[self] >= int(first or 1)

            def changed():
                for n, t in weights:
                    if on and n == name:
                        t = t.clone()
                        t[0] = -t[0]
                    yield n, t
            return load_weights(self, changed())
        return _load_weights

    return _wrap(vllm_engine.VLLMRollout, "load_weights", make)


# name -> (the module it patches, the patch: (module, value) -> undo)
FAULTS = {
    "regression_at_steps": ("verl_hpc.trainer.stages.sampling", regression_at_steps),
    "rollout_logprob_shift": ("verl_hpc.trainer.stages.correction", rollout_logprob_shift),
    "warning_signal_at_step": ("verl_hpc.trainer.programs.rl", warning_signal_at_step),
    "warning_signal_mid_generation": ("verl_hpc.trainer.programs.rl", warning_signal_mid_generation),
    "rollout_holds_mid_batch": ("verl_hpc.trainer.placement.rollout_worker", rollout_holds_mid_batch),
    "rollout_chunk_delay_s": ("verl_hpc.trainer.placement.rollout_worker", rollout_chunk_delay_s),
    "rollout_group_delay_s": ("verl_hpc.trainer.placement.rollout_worker", rollout_group_delay_s),
    "elastic_worker_group_delay_s": ("verl_hpc.trainer.placement.elastic.worker", elastic_worker_group_delay_s),
    "elastic_worker_stalls_in_fetch": ("verl_hpc.trainer.placement.elastic.channel", elastic_worker_stalls_in_fetch),
    "rollout_serves_other_values": ("verl_hpc.rollout.vllm.engine", rollout_serves_other_values),
}


def _checked(faults: Dict) -> Dict:
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown test faults {unknown}; known: {sorted(FAULTS)}")
    return dict(faults)


def patch(module, name: str, value) -> Callable[[], None]:
    """Fault `name` with `value` into its (imported) module; returns what undoes it."""
    return FAULTS[name][1](module, value)


# ------------------------------------------------------------------------------ in this process
@contextlib.contextmanager
def injected(**faults) -> Iterator[None]:
    """The faults in this process for the block (a job run by jobs.run_here, a trainer built here)."""
    undo = []
    try:
        for name, value in _checked(faults).items():
            undo.append(patch(importlib.import_module(FAULTS[name][0]), name, value))
        yield
    finally:
        for u in reversed(undo):
            u()


# ------------------------------------------------------------------------------ in subprocesses
def env(base: Dict[str, str] = None, **faults) -> Dict[str, str]:
    """`base` (default: this environment) with the faults for every Python process started with it."""
    e = dict(os.environ if base is None else base)
    e[ENV] = json.dumps(_checked(faults))
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), e.get("PYTHONPATH")]))
    return e


class _PatchAfterImport:
    """A sys.meta_path finder: the module found by the finders after it, with the faults applied
    right after the module's code has run (before the importer sees it)."""

    def __init__(self, pending: Dict[str, list]):
        self.pending = pending  # module -> [(fault, value)]

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        faults, run = self.pending.pop(fullname), spec.loader.exec_module

        def exec_module(module):
            run(module)
            for name, value in faults:
                patch(module, name, value)

        spec.loader.exec_module = exec_module
        return spec


def install_from_env() -> None:
    """sitecustomize's part: the faults of $VERL_HPC_TEST_FAULTS, each applied when its module is imported."""
    pending = {}
    for name, value in _checked(json.loads(os.environ[ENV])).items():
        pending.setdefault(FAULTS[name][0], []).append((name, value))
    sys.meta_path.insert(0, _PatchAfterImport(pending))
