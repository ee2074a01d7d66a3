"""data.tasks through the config and the loader: tagged rows, per-task data_source, the sampler the
loader builds, the validation set, and the one-line config errors."""
import pytest

from verl_hpc.config import load_config
from verl_hpc.config.errors import ConfigError
from verl_hpc.config.validate import validate
from verl_hpc.data import PromptLoader, load_val_dataset
from verl_hpc.data.tasks import TaskSampler


def job(*overrides):
    return load_config(None, ["data.train_files=[]", "data.val_files=[]", *overrides])


def test_loader_tags_rows_by_task_and_draws_by_weight(files, tokenizer):
    a = files.jsonl("a.jsonl", [files.row(i) for i in range(6)])
    b = files.jsonl("b.jsonl", [files.row(i, source="math", truth=str(2 * i)) for i in range(9)])
    va = files.jsonl("va.jsonl", [files.row(i) for i in range(3)])
    cfg = job(f"data.tasks={{alpha: {{train_files: [{a}], val_files: [{va}], weight: 1}}, "
              f"beta: {{train_files: [{b}], weight: 2, data_source: openai/gsm8k}}}}", "data.train_batch_size=6")
    loader = PromptLoader.from_config(cfg.data, tokenizer)
    assert isinstance(loader.sampler, TaskSampler)
    batch = loader.next_batch()
    tasks = [e["task"] for e in batch.extras]
    assert tasks.count("alpha") == 2 and tasks.count("beta") == 4
    assert {ds for ds, t in zip(batch.data_sources, tasks) if t == "beta"} == {"openai/gsm8k"}
    loader.set_task_weights({"alpha": 1.0, "beta": 1.0})
    assert [e["task"] for e in loader.next_batch().extras].count("alpha") == 3
    val = load_val_dataset(cfg.data, tokenizer)
    assert len(val) == 3 and {r.extra["task"] for r in val.records} == {"alpha"}


@pytest.mark.parametrize("overrides, message", [
    (["data.tasks={a: {train_files: [x.jsonl]}}", "data.mixture={gsm8k: 1.0}"],
     "data.mixture and data.tasks are both set: data.tasks replaces data.mixture"),
    (["data.tasks={a: {train_files: [x.jsonl]}}", "data.train_files=[y.jsonl]"],
     "data.train_files and data.tasks are both set"),
    (["data.tasks={a: {train_files: [x.jsonl], weight: 0.05}}", "data.task_weights.schedule=plateau"],
     "data.task_weights.min_weight = 0.1 is above the weight of task(s) ['a']"),
    (["data.tasks={a: {train_files: []}}"], "data.tasks.a.train_files: empty"),
    (["data.tasks={'a b': {train_files: [x.jsonl]}}"], "data.tasks.a b: a task name is 1-63 letters"),
    (["data.task_weights.schedule=plateau", "data.train_files=[x.jsonl]"],
     "data.task_weights.schedule = plateau: needs data.tasks"),
    (["data.train_files=[x.jsonl]", "trainer.rollback.enable=true", "checkpoint.save_every=1",
      "checkpoint.keep_last=1", "trainer.rollback.rollback_steps=3"],
     "checkpoint.keep_last = 1 (every 1 steps) may keep no checkpoint 3 steps back"),
])
def test_task_and_rollback_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(job(*overrides), check_model=False)
    assert message in str(e.value), str(e.value)
