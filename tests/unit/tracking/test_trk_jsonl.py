"""metrics.jsonl: one strict-JSON object per step, non-finite values as null, resume truncation."""
import json
import math

from verl_hpc.tracking import read_history, truncate_from
from verl_hpc.tracking.jsonl import JsonlBackend


def lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def write_steps(out, steps, start_step=None, tag=0.0):
    b = JsonlBackend(out, start_step=start_step)
    for s in steps:
        b.log({"reward/mean": s + tag}, s)
    b.close()
    return b.path


def test_one_object_per_step_with_step_and_time(tmp_path):
    b = JsonlBackend(tmp_path)
    b.log({"reward/mean": 0.5, "actor/pg_loss": -0.1}, 1)
    b.log({"reward/mean": 0.75}, 2)
    # flushed per line: a reader sees it before close (tail -f, a killed job)
    rows = lines(tmp_path / "metrics.jsonl")
    b.close()
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["actor/pg_loss"] == -0.1
    assert all(isinstance(r["time"], float) and r["time"] > 1e9 for r in rows)
    assert "nonfinite" not in rows[0]


def test_nonfinite_written_as_null_and_listed(tmp_path):
    b = JsonlBackend(tmp_path)
    b.log({"actor/kl": math.nan, "actor/pg_loss": math.inf, "critic/vf_loss": -math.inf,
           "reward/mean": 1.0}, 3)
    b.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON for jq, pandas, ...
    (row,) = lines(tmp_path / "metrics.jsonl")
    assert row["actor/kl"] is None and row["actor/pg_loss"] is None and row["critic/vf_loss"] is None
    assert row["nonfinite"] == ["actor/kl", "actor/pg_loss", "critic/vf_loss"]
    assert row["reward/mean"] == 1.0
    (back,) = read_history(tmp_path / "metrics.jsonl")
    assert math.isnan(back["actor/kl"]) and back["reward/mean"] == 1.0


def test_resume_with_start_step_drops_replayed_steps(tmp_path):
    path = write_steps(tmp_path, range(1, 8))                       # first attempt died after 7
    write_steps(tmp_path, range(5, 10), start_step=5, tag=100.0)     # restarted from checkpoint 5
    rows = lines(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [r["reward/mean"] for r in rows[4:]] == [105.0, 106.0, 107.0, 108.0, 109.0]


def test_resume_without_start_step_truncates_at_first_write(tmp_path):
    path = write_steps(tmp_path, range(1, 8))
    write_steps(tmp_path, range(4, 6), tag=100.0)
    assert [(r["step"], r["reward/mean"]) for r in lines(path)] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0)]


def test_truncate_from_function_and_cut_short_last_line(tmp_path):
    path = write_steps(tmp_path, range(1, 5))
    with path.open("a") as f:
        f.write('{"step": 5, "reward/me')  # the process was killed mid-write
    assert [r["step"] for r in read_history(path)] == [1, 2, 3, 4]  # the reader skips it
    assert truncate_from(path, 3) == 3  # steps 3, 4 and the broken line
    assert [r["step"] for r in lines(path)] == [1, 2]
    assert truncate_from(path, 10) == 0
    assert truncate_from(tmp_path / "absent.jsonl", 1) == 0


def test_unterminated_valid_last_line_gets_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 1.0, "a": 1}\n{"step": 2, "time": 2.0, "a": 2}')
    write_steps(tmp_path, [3])
    assert [r["step"] for r in lines(path)] == [1, 2, 3]


def test_backend_truncate_from_keeps_appending(tmp_path):
    b = JsonlBackend(tmp_path)
    for s in range(1, 6):
        b.log({"x": float(s)}, s)
    assert b.truncate_from(3) == 3
    b.log({"x": 30.0}, 3)
    b.close()
    assert [(r["step"], r["x"]) for r in lines(b.path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_history_lines_for_a_checkpoint_and_back(tmp_path):
    from verl_hpc.tracking.jsonl import lines_until, restore_lines

    src = tmp_path / "a" / "metrics.jsonl"
    src.parent.mkdir()
    src.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')  # cut short
    saved = lines_until(src, 2)
    assert saved == '{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n'
    assert lines_until(src, 1).count("\n") == 1 and lines_until(tmp_path / "none", 5) == ""

    dst = tmp_path / "b" / "metrics.jsonl"  # a resume into a new output directory
    assert restore_lines(dst, saved, 2) and dst.read_text() == saved
    assert not restore_lines(dst, saved, 2)  # already there: left alone
    dst.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x": 9.0}\n')
    assert not restore_lines(dst, saved, 2)  # the local file is the same run's: kept as it is
    assert dst.read_text().count("\n") == 3


def test_metric_history_travels_in_a_rank_state(tmp_path):
    """What TrainerCheckpointer does with it: rank 0's rank_state carries the rows up to the step."""
    from verl_hpc.tracking.history import HISTORY_KEY, MetricHistory

    src = MetricHistory(tmp_path / "a")
    assert src.snapshot(2) == {}  # no jsonl backend, no file: nothing to carry
    src.path.parent.mkdir()
    src.path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x": 3.0}\n')
    rank_state = {"rng": b"...", **src.snapshot(2)}
    assert rank_state[HISTORY_KEY].decode().count("\n") == 2
    dst = MetricHistory(tmp_path / "b")
    assert dst.restore(rank_state, 2) and dst.path.read_text().count("\n") == 2
    assert not dst.restore({}, 2)  # a checkpoint without history: nothing happens
