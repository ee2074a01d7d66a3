"""Model folders derived from a tiny one, for tests that need a layout the tiny builder does not make."""
import json
from pathlib import Path
from typing import Dict, Tuple

import torch
from safetensors.torch import load_file


def copy_saying(src: Path, out: Path, **config) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """`src`'s files in a new folder `out`, its config.json updated with `config`; returns (the new
    config, `src`'s tensors) for the caller to change and save as `out`/model.safetensors."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    merged = {**json.loads((src / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps(merged))
    return merged, load_file(str(src / "model.safetensors"))
