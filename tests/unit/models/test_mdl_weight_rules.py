"""HF <-> Megatron tensor rules without Megatron: shards at every TP size reassemble to the HF
tensors exactly, the fused layouts are the verified ones, and the reader reads slices lazily."""
import json

import pytest
import torch
from safetensors.torch import save_file

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.config_mapping import padded_vocab_size, parse_hf_config
from verl_hpc.models.hf_checkpoint import HFCheckpointReader, WeightFileError
from verl_hpc.models.weight_rules import LAYER_RULES, Layout, layer_rules, model_rules, rule_for


# 8 heads in 4 query groups of head_dim 8: TP 1, 2 and 4 all split it; vocab 50 pads.
ARCH = parse_hf_config({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 50, "hidden_size": 64,
                        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "tie_word_embeddings": False})


class DictReader:
    """The HFCheckpointReader interface over an in-memory state dict."""

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def read(self, name, index=None):
        t = self.tensors[name]
        return t.clone() if index is None else t[index].clone()


def hf_state(arch, layer=0):
    gen = torch.Generator().manual_seed(0)
    names = {}
    for rule in list(layer_rules(arch).values()) + list(model_rules(arch).values()):
        names.update(dict(rule.hf_entries(arch, layer)))
    return {n: torch.randn(shape, generator=gen) for n, shape in names.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("megatron_name", sorted(layer_rules(ARCH)) + sorted(model_rules(ARCH)))
def test_shards_reassemble_to_the_hf_tensors(megatron_name, tp):
    reader = DictReader(hf_state(ARCH))
    full_name = f"decoder.layers.0.{megatron_name}" if megatron_name in LAYER_RULES else megatron_name
    rule, layer = rule_for(full_name, ARCH, {0: 0})
    padded = padded_vocab_size(ARCH.vocab_size, tp)
    shards = [rule.load(reader, ARCH, layer, Layout(r, tp, padded)) for r in range(tp)]
    if rule.tp_dim is None:
        assert all(torch.equal(s, shards[0]) for s in shards)
        full = shards[0]
    else:
        assert len({tuple(s.shape) for s in shards}) == 1, "TP shards must be equal in size"
        full = torch.cat(shards, dim=rule.tp_dim)
    for name, tensor in rule.to_hf(full, ARCH, layer, Layout(0, tp, padded)):
        assert torch.equal(tensor, reader.tensors[name]), (name, tp)


def test_qkv_is_fused_per_query_group_and_split_by_group():
    hd, hpg = ARCH.head_dim, ARCH.heads_per_group
    q = torch.arange(8).repeat_interleave(hd).float().unsqueeze(1)  # row value = q head index
    k = (100 + torch.arange(4)).repeat_interleave(hd).float().unsqueeze(1)
    v = (200 + torch.arange(4)).repeat_interleave(hd).float().unsqueeze(1)
    reader = DictReader({f"model.layers.0.self_attn.{p}_proj.weight": t for p, t in zip("qkv", (q, k, v))})
    rule = LAYER_RULES["self_attention.linear_qkv.weight"]
    shard = rule.load(reader, ARCH, 0, Layout(1, 2, 64))  # TP rank 1 of 2: groups 2 and 3
    heads = shard[::hd, 0].tolist()
    assert heads == [4, 5, 102, 202, 6, 7, 103, 203]
    assert shard.shape[0] == 2 * (hpg + 2) * hd


def test_fc1_is_gate_then_up_per_rank():
    gate = torch.zeros(96, 64)
    up = torch.ones(96, 64)
    reader = DictReader({"model.layers.0.mlp.gate_proj.weight": gate,
                         "model.layers.0.mlp.up_proj.weight": up})
    shard = LAYER_RULES["mlp.linear_fc1.weight"].load(reader, ARCH, 0, Layout(1, 2, 64))
    assert shard.shape == (96, 64) and shard[:48].sum() == 0 and shard[48:].eq(1).all()


def test_vocab_padding_rows_are_zero_and_dropped():
    reader = DictReader(hf_state(ARCH))
    rule = model_rules(ARCH)["output_layer.weight"]
    shards = [rule.load(reader, ARCH, None, Layout(r, 2, 256)) for r in range(2)]  # 50 -> 256
    assert shards[1].abs().sum() == 0, "rank 1 holds only padding rows"
    (name, back), = rule.to_hf(torch.cat(shards), ARCH, None, Layout(0, 2, 256))
    assert name == "lm_head.weight" and back.shape == (50, 64)


def test_tied_output_layer_reads_the_embedding_and_unknown_names_fail():
    tied = parse_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 50,
                            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                            "num_attention_heads": 8, "num_key_value_heads": 4,
                            "tie_word_embeddings": True})
    assert model_rules(tied)["output_layer.weight"].hf == "model.embed_tokens.weight"
    with pytest.raises(KeyError, match="no HF mapping for Megatron parameter"):
        rule_for("decoder.layers.0.mlp.router.weight", tied, {0: 0})


def test_layer_offsets_come_from_the_stage_map():
    rule, layer = rule_for("decoder.layers.1.input_layernorm.weight", ARCH, {0: 6, 1: 7})
    assert layer == 7 and rule.hf_entries(ARCH, layer)[0][0] == "model.layers.7.input_layernorm.weight"


def _write(folder, tensors, shards):
    folder.mkdir(exist_ok=True)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    names, weight_map = sorted(tensors), {}
    for k in range(shards):
        fname = f"part{k}.safetensors"
        save_file({n: tensors[n] for n in names[k::shards]}, str(folder / fname))
        weight_map.update({n: fname for n in names[k::shards]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 2])
def test_reader_reads_slices_lazily(tmp_path, shards):
    tensors = {"a": torch.arange(24.0).reshape(6, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    _write(tmp_path / "m", tensors, shards)
    reader = HFCheckpointReader(tmp_path / "m")
    assert reader.shape("a") == (6, 4) and reader.dtype("b") == torch.bfloat16 and "a" in reader
    assert torch.equal(reader.read("a", (slice(2, 4),)), tensors["a"][2:4])
    assert torch.equal(reader.read("a", (slice(None), slice(1, 3))), tensors["a"][:, 1:3])
    assert reader.bytes_read == (8 + 12) * 4, "only the selected elements are copied out"
    with pytest.raises(WeightFileError, match="has no tensor 'c'"):
        reader.read("c")


def test_reader_errors_name_the_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no .safetensors file.*\.bin checkpoints are not supported"):
        HFCheckpointReader(tmp_path / "empty")
    _write(tmp_path / "m", {"a": torch.ones(2), "b": torch.ones(2)}, 2)
    (tmp_path / "m" / "part1.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"index.json lists files that are not in .*: part1"):
        HFCheckpointReader(tmp_path / "m")
