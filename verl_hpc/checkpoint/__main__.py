"""python -m verl_hpc.checkpoint COMMAND CKPT

    inspect CKPT [--json]   step, writer layout, metadata and config summary, tensors with global
                            shapes, dtypes and piece counts
    verify CKPT             read every dataset of every file and check its checksums (exit 1 if bad)

CKPT is a checkpoint directory (step_000120) or a checkpoint root (its `latest` is used).
Exit codes are those of the error classes (docs/errors.md): 0 ok, 21 no such checkpoint (or a file
it lists is missing), 22 damaged (verify's listed problems, a bad index or `latest`, a rank file
whose size disagrees with the index or that is not HDF5), otherwise the error's own code. Ctrl-C
ends it with one line (`[checkpoint] stopped by SIGINT during verify`) and 130; an export removes
its unfinished shards first.

    export CKPT --hf OUT    the actor as a Hugging Face folder (safetensors, config.json, tokenizer;
                            verl_hpc/checkpoint/hf_export.py); single process, any saving layout;
                            a LoRA run's adapter merged into its base
    export CKPT --peft OUT  a LoRA run's adapter as a PEFT folder that `peft` loads onto the base
                            OUT is a new or empty folder, or one holding a model with --overwrite
                            (then it holds exactly the new export); never a folder the export
                            reads from (the run's base model above all), even with --overwrite

Subcommands are registered with @subcommand.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Callable, Optional

import yaml

from verl_hpc.checkpoint import hf_export
from verl_hpc.checkpoint.errors import CheckpointCorruptError
from verl_hpc.checkpoint.load import CheckpointReader
from verl_hpc.errors import VerlHpcError


@dataclasses.dataclass
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def subcommand(name: str, help: str, add_arguments: Callable = lambda p: None):
    def register(run):
        SUBCOMMANDS[name] = Subcommand(name, help, add_arguments, run)
        return run
    return register


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _config_summary(text: str, width: int = 100) -> list[str]:
    """One line per top-level section of a YAML config: its scalar fields, cut at `width`."""
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"(config is not valid YAML: {e})"]
    if not isinstance(cfg, dict):
        return [f"(config is a {type(cfg).__name__})"]
    lines = []
    for section, body in cfg.items():
        if isinstance(body, dict):
            fields = " ".join(f"{k}={v}" for k, v in body.items() if not isinstance(v, (dict, list)))
        else:
            fields = str(body)
        line = f"{section}: {fields}"
        lines.append(line if len(line) <= width else line[:width - 3] + "...")
    return lines


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


@subcommand("inspect", "list tensors, shapes, dtypes, pieces, step and config", _inspect_args)
def inspect(args: argparse.Namespace) -> int:
    with CheckpointReader(args.ckpt) as r:
        r.check_files()  # the index alone would describe a checkpoint whose rank files are cut short
        tensors = r.tensors()
        if args.json:
            print(json.dumps(dict(path=str(r.path), step=r.step, world_size=r.world_size, layout=r.layout,
                                  created=r.index.get("created"), metadata_keys=sorted(r.metadata),
                                  tensors={n: dict(global_shape=list(t.global_shape),
                                                   dtype=str(t.dtype).removeprefix("torch."),
                                                   pieces=len(t.pieces)) for n, t in tensors.items()})))
            return 0
        nbytes = sum(f["bytes"] for f in r.index["files"])
        print(f"checkpoint {r.path}")
        print(f"  step {r.step}, written {r.index.get('created')} by {r.world_size} rank(s), "
              f"layout {json.dumps(r.layout)}")
        print(f"  {len(r.index['files'])} file(s), {_mb(nbytes)}; metadata keys: {sorted(r.metadata)}")
        config = r.metadata.get("config")
        if isinstance(config, str):
            print(f"  config ({len(config.splitlines())} lines of YAML):")
            for line in _config_summary(config):
                print(f"    {line}")
        width = max([len(n) for n in tensors] + [6])
        print(f"tensors ({len(tensors)}):")
        print(f"  {'name':<{width}}  {'dtype':<14} {'global shape':<22} pieces")
        for n, t in tensors.items():
            print(f"  {n:<{width}}  {str(t.dtype).removeprefix('torch.'):<14} "
                  f"{str(list(t.global_shape)):<22} {len(t.pieces)}")
    return 0


@subcommand("verify", "read every dataset and check its checksums")
def verify(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    with CheckpointReader(args.ckpt) as r:  # a damaged index or `latest`: an error line, code 22
        nbytes, errors = r.verify()
        dt = time.perf_counter() - t0
        if errors:
            print(f"DAMAGED: {r.path}: {len(errors)} problem(s)")
            for e in errors:
                print(f"  {e}")
            return CheckpointCorruptError.exit_code
        pieces = sum(len(t.pieces) for t in r.tensors().values())
        print(f"OK: {r.path}: step {r.step}, {len(r.index['tensors'])} tensors in {pieces} pieces, "
              f"{r.world_size} rank state(s); {_mb(nbytes)} checked in {dt:.2f} s "
              f"({nbytes / 1e6 / max(dt, 1e-9):.0f} MB/s)")
    return 0


def _register_export() -> None:
    subcommand("export", "write the actor as a Hugging Face folder (--hf OUT) or a LoRA run's adapter as "
                         "a PEFT folder (--peft OUT)",
               hf_export.add_arguments)(hf_export.run_cli)


_register_export()


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_hpc.checkpoint",
                                     description="Inspect, verify and export verl_hpc HDF5 checkpoints.")
    subs = parser.add_subparsers(dest="command", required=True)
    for cmd in SUBCOMMANDS.values():
        p = subs.add_parser(cmd.name, help=cmd.help)
        p.add_argument("ckpt", help="checkpoint directory, or a root with a `latest` file")
        cmd.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args)
    except VerlHpcError as e:  # export may also meet a config or weights error
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C: one line and 128 + SIGINT, as submit and plan end (docs/signals.md)
        sys.stdout.flush()  # export's own handlers have removed its unfinished shards on the way here
        tail = "; the export is not complete: run it again" if args.command == "export" else ""
        print(f"[checkpoint] stopped by SIGINT during {args.command}{tail}", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
