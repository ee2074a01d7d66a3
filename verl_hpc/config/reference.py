"""`configs/base.yaml`, generated: every field of the schema with its default, choices, range and
help text, so the reference users read cannot drift from the declarations in `sections/`.

Fields that an algorithm recipe sets are written commented out: a value written in a file outranks
the recipe, so a base file that set them would silently cancel the recipe of every config
extending it. `python -m verl_hpc.config --print-base > configs/base.yaml` rewrites the file; a
unit test fails when the file and the schema differ.
"""
from __future__ import annotations

import dataclasses
from typing import List, Set

import yaml

from verl_hpc.config.fields import valid_choices
from verl_hpc.config.schema import JobConfig

HEADER = """\
# verl_hpc: every config field with its default. GENERATED from the schema
# (verl_hpc/config/sections/) by `python -m verl_hpc.config --print-base`; do not edit by hand.
#
# Start a job config with `extends: base.yaml` and set only what differs. Precedence, lowest first:
#   schema defaults < algorithm.recipe < extended files (in order) < this file < CLI overrides
# CLI: python -m verl_hpc.config configs/smoke.yaml trainer.total_steps=20 data.train_files=[a.parquet]
#      (add --print-config to see the resolved YAML).
# ${a.b} refers to another field; ${oc.env:VAR} to an environment variable; \\${x} is a literal "${x}".
# "auto" fields (empty string, null or 0 as noted) are filled in when the config is loaded.
# Fields commented out are set by algorithm recipes (algorithm.recipe); set them in your own config.
"""
COMMENT_COLUMN = 30


def _recipe_keys() -> Set[str]:
    from verl_hpc.config.recipes import RECIPES

    keys: Set[str] = set()

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("mixture",):
                walk(v, f"{prefix}{k}.")
            keys.add(f"{prefix}{k}")

    for recipe in RECIPES.values():
        walk(recipe, "")
    return keys


def _scalar(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4] if text.endswith("\n...") else text.removesuffix("...").strip()


def _comment(meta: dict) -> str:
    parts = []
    choices = valid_choices(meta)
    if choices and len(choices) < 12:
        parts.append(" | ".join(choices))
    if meta.get("check"):
        parts.append({">0": "> 0", ">=0": ">= 0"}.get(meta["check"], meta["check"]))
    if meta.get("auto"):
        parts.append(f"auto: {meta['auto']}")
    if meta.get("help"):
        parts.append(meta["help"])
    return "; ".join(parts)


def _lines(obj, prefix: str, indent: str, recipe_keys: Set[str], parent_hidden: bool = False) -> List[str]:
    out: List[str] = []
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        hidden = "# " if parent_hidden or key in recipe_keys else ""
        if dataclasses.is_dataclass(value):
            head = f"{indent}{hidden}{f.name}:"
            note = f.metadata.get("help", "")
            out.append(head.ljust(COMMENT_COLUMN) + f"  # {note}" if note else head)
            out += _lines(value, key + ".", indent + "  ", recipe_keys, bool(hidden))
            continue
        text = f"{indent}{hidden}{f.name}: {_scalar(value)}"
        note = _comment(f.metadata)
        out.append(text.ljust(COMMENT_COLUMN) + f"  # {note}" if note else text)
    return out


def base_yaml() -> str:
    cfg, recipe_keys = JobConfig(), _recipe_keys()
    blocks = []
    for f in dataclasses.fields(cfg):
        note = f.metadata.get("help", "")
        head = f"{f.name}:".ljust(COMMENT_COLUMN) + (f"  # {note}" if note else "")
        blocks.append("\n".join([head] + _lines(getattr(cfg, f.name), f"{f.name}.", "  ", recipe_keys)))
    return HEADER + "\n" + "\n\n".join(blocks) + "\n"
