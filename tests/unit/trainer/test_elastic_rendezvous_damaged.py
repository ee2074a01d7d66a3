"""`submit --join` on a damaged rendezvous file or on a run whose store is gone (issue 67 item 11):
one line naming the file and the field (exit 30), never a Python or c10d traceback."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from verl_hpc.config import load_config
from verl_hpc.trainer.placement.elastic.rendezvous import ElasticJoinError, Rendezvous

RUN = ["model.path=/models/run", "data.train_files=[t.parquet]", "rollout.n=4"]
ROOT = Path(__file__).resolve().parents[3]


def _written(tmp_path, **changes) -> Path:
    rdv = Rendezvous.create(tmp_path, load_config(None, RUN), store=("127.0.0.1", 29501), epoch=0).write()
    data = json.loads(rdv.path.read_text())
    data.update(changes)
    rdv.path.write_text(json.dumps(data))
    return rdv.path


@pytest.mark.parametrize("changes, says", [
    (dict(status="completed", ended="yesterday"), "field 'ended' is 'yesterday'; expected a number"),
    (dict(store=["node17", "http"]), "field 'store' has port 'http'; expected an integer in 1..65535"),
    (dict(store="node17:29501"), "field 'store' is 'node17:29501'; expected [host, port]"),
    (dict(epoch="2"), "field 'epoch' is '2'; expected an integer >= 0"),
    (dict(status="finished"), "field 'status' is 'finished'; expected one of running, completed, stopped, failed"),
])
def test_a_damaged_rendezvous_file_is_one_line_naming_the_field(tmp_path, changes, says):
    path = _written(tmp_path, **changes)
    with pytest.raises(ElasticJoinError) as e:
        Rendezvous.join(tmp_path)
    text = str(e.value)
    assert text.startswith(f"{path}: {says}") and "\n" not in text and e.value.exit_code == 30, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_running_run_whose_store_is_gone_is_refused_naming_the_store(tmp_path):
    port = _free_port()  # nobody listens there any more
    rdv = Rendezvous.create(tmp_path, load_config(None, RUN), store=("127.0.0.1", port), epoch=0).write()
    with pytest.raises(ElasticJoinError) as e:
        Rendezvous.join(tmp_path).check_store(timeout_s=2)
    assert str(e.value).startswith(f"{rdv.path}: the run's store at 127.0.0.1:{port} (field 'store') does not answer")
    with socket.socket() as listening:  # and a store that answers passes
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        Rendezvous.create(tmp_path, load_config(None, RUN), store=listening.getsockname(), epoch=0).write()
        Rendezvous.join(tmp_path).check_store(timeout_s=2)


@pytest.mark.heavy
def test_submit_join_prints_one_line_and_exits_30(tmp_path):
    _written(tmp_path, store=["node17", "http"])
    proc = subprocess.run([sys.executable, "-m", "verl_hpc.submit", "--join", str(tmp_path), "--local"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 30, proc.stderr
    assert "Traceback" not in proc.stderr and "field 'store' has port 'http'" in proc.stderr, proc.stderr
