"""How a rollout worker finds an elastic run (trainer/placement/elastic/rendezvous.py): the file
the run writes, and one line naming why a worker cannot join (no run there, an ended run, another
config), with the fields a worker may set for its own engine left free."""
import pytest

from verl_hpc.config import load_config
from verl_hpc.trainer.placement.elastic.rendezvous import ElasticJoinError, Rendezvous

RUN = ["model.path=/models/run", "data.train_files=[t.parquet]", "rollout.n=4", "data.max_response_length=512"]


def refusal(*args) -> str:
    with pytest.raises(ElasticJoinError) as e:
        Rendezvous.join(*args)
    text = str(e.value)
    assert "\n" not in text and e.value.exit_code == 30
    return text


def test_a_worker_finds_the_running_run_and_not_an_ended_one(tmp_path):
    assert "has no elastic/rendezvous.json: it is not an elastic run" in refusal(tmp_path)
    cfg = load_config(None, RUN)
    rdv = Rendezvous.create(tmp_path, cfg, store=("node17", 29501), epoch=2).write()
    got = Rendezvous.join(tmp_path)
    assert (got.store, got.epoch, got.status) == (("node17", 29501), 2, "running")
    assert got.shared["rollout.n"] == 4 and got.shared["model.path"] == "/models/run"
    rdv.finish("completed")
    assert refusal(tmp_path).startswith(f"the run in {tmp_path} has ended (completed at ")
    (tmp_path / "elastic" / "rendezvous.json").write_text("{not json")
    assert "is not a rendezvous file" in refusal(tmp_path)


@pytest.mark.parametrize("override, field", [
    ("model.path=/models/other", "model.path"),
    ("rollout.n=8", "rollout.n"),
    ("rollout.temperature=0.7", "rollout.temperature"),
    ("data.max_response_length=1024", "data.max_response_length"),
])
def test_a_worker_of_another_config_is_refused_naming_the_field(tmp_path, override, field):
    Rendezvous.create(tmp_path, load_config(None, RUN), store=("n1", 1), epoch=0).write()
    text = refusal(tmp_path, load_config(None, RUN + [override]))
    assert text.startswith(f"the worker's {field} = ") and "differs from the run's" in text


def test_a_worker_sets_its_own_engine(tmp_path):
    Rendezvous.create(tmp_path, load_config(None, RUN), store=("n1", 1), epoch=0).write()
    mine = load_config(None, RUN + ["rollout.tp=2", "rollout.gpu_memory_utilization=0.8", "rollout.engine=hf"])
    assert Rendezvous.join(tmp_path, mine).epoch == 0
