"""`python -m verl_hpc.config [CONFIG] [key=value ...] [--print-config] [--skip-model-check] [--print-base]`

Loads and validates a config the way a job would. Prints a one-line summary (or, with
--print-config, the resolved YAML, printed even when the semantic checks then fail) and exits 0;
a bad config prints `error: <message>` on stderr and exits 2, without a traceback. Ctrl-C prints
`[config] stopped by SIGINT before the config was checked` and exits 130.
--skip-model-check skips reading model.path (for big configs on machines without the model).
--print-base prints the generated reference of every field (configs/base.yaml) and exits.
"""
from __future__ import annotations

import sys
from typing import List, Optional

from verl_hpc.config import ConfigError, load_config, to_yaml, validate
from verl_hpc.errors import VerlHpcError

USAGE = ("usage: python -m verl_hpc.config [CONFIG.yaml] [key=value ...] [--print-config] [--skip-model-check]"
         " [--print-base]")


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C: one line and 128 + SIGINT, as submit and plan end (docs/signals.md)
        sys.stdout.flush()
        print("[config] stopped by SIGINT before the config was checked", file=sys.stderr, flush=True)
        return 130


def _main(args: List[str]) -> int:
    if "-h" in args or "--help" in args:
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n", 1)[1].strip())
        return 0
    flags = {a for a in args if a.startswith("--")}
    unknown = flags - {"--print-config", "--skip-model-check", "--print-base"}
    positional = [a for a in args if not a.startswith("--")]
    if "--print-base" in flags and not unknown:
        from verl_hpc.config.reference import base_yaml

        sys.stdout.write(base_yaml())
        return 0
    try:
        if unknown:
            raise ConfigError(f"unknown option {sorted(unknown)[0]!r}; {USAGE}")
        # The config file is the first argument when it is not an override; the rest are overrides
        # (parse_override then reports a stray word as a malformed override).
        path = positional.pop(0) if positional and "=" not in positional[0] else None
        cfg = load_config(path, positional)
        if "--print-config" in flags:  # before the semantic checks: seeing it helps fix them
            sys.stdout.write(to_yaml(cfg))
        validate(cfg, check_model="--skip-model-check" not in flags)
    except VerlHpcError as e:  # a ConfigError (2); reading model.path may meet another known error
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if "--print-config" not in flags:
        p = cfg.parallel
        print(f"ok: {path or 'defaults'}: trainer.job={cfg.trainer.job}, world size {cfg.world_size} "
              f"({cfg.slurm.nodes} node(s) x {cfg.slurm.tasks_per_node}), tp={p.tp} pp={p.pp} "
              f"{f'cp={p.cp} ' if p.cp > 1 else ''}dp={cfg.dp}, "
              f"rollout.tp={cfg.rollout.tp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
