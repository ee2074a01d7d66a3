"""The rules of Ulysses sequence parallelism on the FSDP engine (verl_hpc/engines/fsdp/ulysses.py):
which head counts split over sp, how often a KV head is repeated, and what the engine refuses at
load with fsdp.sp > 1 (one line each, before any weight moves). Equality with sp = 1 on 4 ranks is
tests/dist/engines/test_fsdp_sp.py."""
from types import SimpleNamespace

import pytest

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.fsdp.ulysses import check_heads, kv_repeats


@pytest.mark.parametrize("heads, kv, sp, repeats", [(32, 8, 8, 1), (32, 8, 4, 1), (32, 8, 16, 2), (4, 1, 4, 4),
                                                    (4, 2, 4, 2), (4, 4, 2, 1)])
def test_kv_heads_split_or_repeat(heads, kv, sp, repeats):
    check_heads(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv), sp)
    assert kv_repeats(kv, sp) == repeats
    assert (kv * repeats) % sp == 0 and heads % (kv * repeats) == 0  # every rank's query heads find theirs


@pytest.mark.parametrize("heads, kv, sp, words", [
    (4, 2, 8, "fsdp.sp = 8 must divide the model's 4 attention heads"),
    (12, 3, 2, "fsdp.sp = 2 and the model's 3 KV heads: one must divide the other"),
])
def test_head_counts_that_do_not_split_are_refused(heads, kv, sp, words):
    with pytest.raises(ConfigError, match=words):
        check_heads(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv), sp)


def test_sliding_window_layers_are_refused():
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, sliding_window=4096,
                             layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ConfigError, match="uses sliding-window attention layers"):
        check_heads(config, 2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sp") / "llama", "llama")


@pytest.mark.parametrize("changes, words", [
    (dict(head="value"), r"a critic or reward model \(value head\) under sequence parallelism is not built yet"),
    (dict(lora="rank4"), r"fsdp.sp = 2 with LoRA \(lora.rank > 0\): not built yet"),
    ({}, "fsdp.sp = 2 must divide the 1 training ranks"),
])
def test_the_engine_refuses_at_load_what_sp_does_not_cover(one_rank_world, folder, changes, words):
    from verl_hpc.config.schema import LoraConfig, OptimConfig
    from verl_hpc.config.sections.fsdp import FsdpConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    if changes.get("lora"):
        changes = dict(changes, lora=LoraConfig(rank=4, alpha=8))
    options = default_options(str(folder), engine="fsdp", optim=OptimConfig(lr=1e-3), temperature=1.0,
                              total_steps=1, micro_batch_size=1, fsdp=FsdpConfig(sp=2), **changes)
    with pytest.raises(ConfigError, match=words):
        FsdpEngine(options)
