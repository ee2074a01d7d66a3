"""What every rank runs: `python -m verl_hpc.job CONFIG [dotted.overrides ...]`.

A known error (config, data, reward, checkpoint, weights, ...; verl_hpc/runtime/errors.py) ends the
rank with one line, `error: ...`, and its class's exit code (docs/errors.md).

The same entry serves every launcher (srun from an sbatch script, submitit, mpirun, torchrun, the
local launcher, a plain `python`): the runtime works out the rank, the config says which program
(`trainer.job`) to run on it.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

if __name__ == "__main__":  # a rank: signals are kept from its first line, before torch is imported
    from verl_hpc.launcher import early_signals  # (launcher/early_signals.py)

    early_signals.keep()

from verl_hpc.launcher.environment import REPRODUCIBLE_CPU  # noqa: E402

# before anything imports torch (a rank started by srun from an sbatch script, or by torchrun,
# gets no environment from the launcher); the user's own value wins
for _name, _value in REPRODUCIBLE_CPU.items():
    os.environ.setdefault(_name, _value)

from verl_hpc.config import ConfigError, JobConfig, from_container, load_config, validate  # noqa: E402
from verl_hpc.launcher.startup_imports import preload, without_gc  # noqa: E402

log = logging.getLogger(__name__)

# trainer.job -> "module:function" taking (cfg, ctx); imported lazily so a smoke job does not pay
# for importing vLLM and Megatron.
PROGRAMS = {
    "smoke": "verl_hpc.trainer.programs.smoke:run",
    "rl": "verl_hpc.trainer.programs.rl:run",
    "sft": "verl_hpc.trainer.programs.sft:run",
    "dpo": "verl_hpc.trainer.programs.preference:run",
}


def resolve_program(name: str):
    if name not in PROGRAMS:
        raise ConfigError(f"trainer.job: '{name}' is not available in this version; "
                          f"valid: {', '.join(sorted(PROGRAMS))}")
    module, func = PROGRAMS[name].split(":")
    return getattr(importlib.import_module(module), func)


def run(cfg: JobConfig | dict[str, Any]) -> dict[str, Any]:
    """Run the configured program on this rank; returns its summary (rank 0's is the job's)."""
    if isinstance(cfg, dict):
        cfg = from_container(cfg)
    # the start-up's imports with the garbage collector off, then the heap frozen (launcher/startup_imports.py)
    with without_gc():
        # local: submit imports this module on the login node to hand `run` to submitit, where the
        # rank runtime (torch.distributed) is not needed
        from verl_hpc import runtime

        program = resolve_program(cfg.trainer.job)
        check_outputs(cfg)
        check_weight_files(cfg)
        ctx = runtime.bootstrap(backend=cfg.parallel.backend, timeout_s=cfg.trainer.collective_timeout_s,
                                seed=cfg.trainer.seed, num_threads=cfg.slurm.cpus_per_task,
                                rollout_ranks=cfg.placement.rollout_ranks if cfg.placement.split else 0,
                                host_collectives=cfg.fsdp.cpu_offload)
        preload(cfg, ctx.role)  # the libraries this rank's role builds its engines with
    from verl_hpc.runtime import heartbeat

    # beats where a restart supervisor watches (launcher/heartbeat.py), with the config's timeout;
    # nothing otherwise
    heartbeat.start(ctx.split.global_rank if ctx.split is not None else ctx.rank, cfg.trainer.heartbeat_timeout_s,
                    cfg.checkpoint.dir)
    from verl_hpc.launcher import early_signals

    early_signals.hand_over(ctx.preemption.record)  # a signal in this rank's start-up: a stop, as later
    from verl_hpc.trainer.hooks.safety import log_banner

    log_banner(cfg, ctx)  # safety.* switches that are on, in every job's log
    try:
        summary = program(cfg, ctx)
        from verl_hpc.launcher.local_stop import note_stop

        # stopped on a signal, or resumed with nothing left to do: the local submitter reads this note
        note_stop(ctx.rank, ctx.preemption.agreed_signal, summary)
        return summary
    finally:
        heartbeat.stop()  # an ended rank's silence is not a stall (its supervisor reads this)
        # past the last step a signal has nothing left to stop, and the flag's handler would be
        # reset to the default as the interpreter exits: a late SIGUSR2 killed a finished rank
        early_signals.ignore()
        runtime.shutdown(ctx)


def check_outputs(cfg) -> None:
    """trainer.output_dir and checkpoint.dir writable (or creatable), as submit checks them before
    the queue, with its words: a rank started without that check (launch/*.sbatch, a hand-written
    script, --skip-file-checks) stops here, before any model is built, instead of with an OSError
    when the metrics file opens."""
    from verl_hpc.config.errors import raise_if_any
    from verl_hpc.launcher.preflight import output_problems

    raise_if_any(output_problems(cfg))


def check_weight_files(cfg) -> None:
    """The model folders' safetensors headers against their config.json, as submit checks them
    before the queue (headers only: a second even for a 70B model). A rank started without those
    checks (a hand-written sbatch script, --skip-file-checks) stops here with one line instead of
    a shape error inside vLLM's or Megatron's weight loader."""
    if cfg.trainer.job == "smoke":  # no model
        return
    from verl_hpc.launcher.preflight import model_problems
    from verl_hpc.launcher.preflight_model import init_from_check
    from verl_hpc.models.hf_checkpoint import WeightFileError

    problems = model_problems(cfg)
    if problems:
        raise WeightFileError("; ".join(problems))
    # lora.init_from, headers only (the engine reads its values once, to load them): an adapter
    # the engine would compute otherwise than PEFT stops here, before vLLM is built
    adapter = init_from_check(cfg, values=False)
    if adapter is not None:
        adapter.raise_first()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        return 0 if argv else 2
    path = None if "=" in argv[0] else argv[0]
    try:
        cfg = load_config(path, argv[1:] if path else argv)
        # Ranks validate again (cheap): an sbatch script may pass overrides never checked by submit.
        validate(cfg, check_model=True)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except Exception as err:  # noqa: BLE001 - known classes become one line; others keep their traceback
        from verl_hpc.runtime.errors import report

        code = report(err, _rank())
        if code is None:
            raise
        return code
    return 0


def _rank() -> int:
    from verl_hpc.runtime.launch_env import detect

    try:
        return detect().rank
    except Exception:  # noqa: BLE001 - only used to label a message
        return 0


if __name__ == "__main__":
    sys.exit(main())
