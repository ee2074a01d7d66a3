"""Helpers for the config tests: YAML files in tmp_path, a fake Hugging Face model folder."""
import json
import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def write(tmp_path):
    """write("name.yaml", '''yaml text''') -> Path, dedented."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return _write


@pytest.fixture
def model_dir(tmp_path):
    """make(heads=32, kv=8, layers=32) -> folder with a Llama-like config.json."""

    def _make(heads=32, kv=8, layers=32, vocab=128256, name="model", **extra) -> str:
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        data = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": heads,
                "num_hidden_layers": layers, "vocab_size": vocab, **extra}
        if kv is not None:
            data["num_key_value_heads"] = kv
        (folder / "config.json").write_text(json.dumps(data))
        return str(folder)

    return _make
