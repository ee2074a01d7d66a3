"""PromptLoader from the typed config: batches, resume through state_dict, validation chunks."""
import json

import pytest

from verl_hpc.config.schema import DataConfig
from verl_hpc.data import DataError, PromptBatch, PromptLoader, load_val_dataset, val_batches


@pytest.fixture
def cfg(files):
    train = files.jsonl("train.jsonl", [files.row(i) for i in range(7)])
    extra = files.parquet("more.parquet", [files.row(i, source="synthetic_arith", extra={"a": i}) for i in range(5)])
    val = files.jsonl("val.jsonl", [files.row(i, source="math") for i in range(5)])
    return DataConfig(train_files=[train, extra], val_files=[val], train_batch_size=4, val_batch_size=2,
                      max_prompt_length=64, seed=3)


def test_next_batch_is_a_full_prompt_batch(cfg, tokenizer):
    loader = PromptLoader.from_config(cfg, tokenizer)
    assert len(loader.dataset) == 12 and loader.steps_per_epoch == 3
    batch = loader.next_batch()
    assert isinstance(batch, PromptBatch) and len(batch) == 4
    records = {r.id: r for r in loader.dataset.records}
    for i, sample_id in enumerate(batch.ids):
        rec = records[sample_id]
        assert (batch.ground_truths[i], batch.data_sources[i], batch.extras[i]) == \
            (rec.ground_truth, rec.data_source, rec.extra)
        assert batch.prompt_ids[i] == tokenizer(batch.prompt_texts[i], add_special_tokens=False)["input_ids"]
    seen = batch.ids + loader.next_batch().ids + loader.next_batch().ids  # one epoch + nothing repeated
    assert len(set(seen)) == 12


def test_loader_resumes_exactly(cfg, tokenizer):
    whole = PromptLoader.from_config(cfg, tokenizer)
    expected = [whole.next_batch().ids for _ in range(7)]
    first = PromptLoader.from_config(cfg, tokenizer)
    got = [first.next_batch().ids for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptLoader.from_config(cfg, tokenizer)
    resumed.load_state_dict(state)
    got += [resumed.next_batch().ids for _ in range(5)]
    assert got == expected and resumed.step == 7
    cfg.train_batch_size = 3
    with pytest.raises(DataError, match="data.train_batch_size = 4"):
        PromptLoader.from_config(cfg, tokenizer).load_state_dict(state)


def test_mixture_from_config(cfg, tokenizer):
    cfg.mixture = {"gsm8k": 3.0, "synthetic_arith": 1.0}
    loader = PromptLoader.from_config(cfg, tokenizer)
    sources = [s for _ in range(5) for s in loader.next_batch().data_sources]
    assert sources.count("gsm8k") == 15 and sources.count("synthetic_arith") == 5
    state = loader.state_dict()
    cfg.mixture = {}
    with pytest.raises(DataError, match="data.mixture"):
        PromptLoader.from_config(cfg, tokenizer).load_state_dict(state)


def test_val_batches_cover_every_prompt_in_order(cfg, tokenizer):
    val = load_val_dataset(cfg, tokenizer)
    chunks = list(val_batches(val, cfg.val_batch_size))
    assert [len(c) for c in chunks] == [2, 2, 1]
    assert [i for c in chunks for i in c.ids] == [f"val.jsonl:{i}" for i in range(5)]
    assert list(val_batches(val, 2))[0].ids == chunks[0].ids  # a fresh pass each time
    cfg.val_files = []
    assert load_val_dataset(cfg, tokenizer) is None
