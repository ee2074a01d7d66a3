"""benchmarks/bench_async.py measure, the parts that run without a job: the figures read from
fabricated metrics.jsonl files (time to the gain, samples/s after the warm-up, the ratios against
the best colocated layout), the jobs' command lines, the flags and their one-line errors, a job that
fails, and the whole command on fabricated jobs."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_async as bench  # noqa: E402  (the entry point)
from async_rl import measure as m  # noqa: E402


def rows(step_s, val=None, samples=128.0, idle=None, t0=1000.0):
    """Metrics rows as a job writes them: step 0 (validation only), then one row per step; `val`
    maps step -> accuracy; the wall clock runs by the step times plus 0.5 s per validation."""
    val = val or {}
    t = t0
    out = [{"step": 0, "time": t, "val/acc/all": val[0]}] if 0 in val else []
    for step, s in enumerate(step_s, start=1):
        t += s + (0.5 if step in val else 0.0)
        r = {"step": step, "time": t, "timing_s/step": s, "train/samples": samples}
        if step in val:
            r.update({"val/acc/all": val[step], "timing_s/validation": 0.5})
        if idle is not None:
            r.update({"async/idle_frac/train": idle[0], "async/idle_frac/rollout": idle[1], "async/staleness_max": 1.0})
        out.append(r)
    return out


def test_time_to_gain_sums_the_step_times_up_to_the_first_crossing():
    r = rows([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], val={0: 0.40, 2: 0.55, 4: 0.71, 6: 0.60})
    g = m.time_to_gain(r, 30)
    assert g["step"] == 4 and g["seconds"] == pytest.approx(5.0)  # steps 1..4, validation left out
    assert g["wall_s"] == pytest.approx(5.0 + 2 * 0.5)  # the rows' clock: validations at 2 and 4 in it
    assert (g["start"], g["reached"]) == (0.40, 0.71)
    assert m.time_to_gain(r, 31)["step"] == 4  # 0.71 - 0.40: 31 points, a float a hair short of it
    assert m.time_to_gain(r, 32) is None  # never reached
    assert m.time_to_gain(rows([1.0, 1.0], val={2: 0.9}), 10) is None  # no start to gain over


def test_summarize_leaves_out_the_warmup_steps():
    r = rows([30.0, 4.0, 4.0, 6.0], samples=64.0, idle=(0.25, 0.5))
    s = m.summarize(r, warmup=1, gain_points=30)
    assert s["samples_per_s"] == pytest.approx(3 * 64.0 / 14.0)  # steps 2..4 only: start-up excluded
    assert s["s_per_step"] == 4.0 and s["steps"] == 4 and s["gain"] is None
    assert s["async/idle_frac/train"] == 0.25 and s["async/idle_frac/rollout"] == 0.5
    with pytest.raises(m.JobFailed, match="no step after --warmup 4"):
        m.summarize(r, warmup=4, gain_points=30)


def test_read_rows_leaves_out_a_line_being_written(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1, "timing_s/step": 1.0}) + '\n{"step": 2, "timi')
    assert m.read_rows(f) == [{"step": 1, "timing_s/step": 1.0}]
    assert m.read_rows(tmp_path / "none.jsonl") == []


def test_the_split_is_compared_with_the_faster_colocated_layout_per_figure():
    fig = lambda seconds, rate: dict(samples_per_s=rate, gain=dict(seconds=seconds) if seconds else None)  # noqa: E731
    c = m.compare({"colocated_1x2": fig(10.0, 5.0), "colocated_2x1": fig(8.0, 4.0), "split": fig(6.0, 7.5)})
    assert c["time_to_gain"] == dict(best_colocated="colocated_2x1", ratio=0.75, goal=0.7, met=False)
    assert c["samples_per_s"] == dict(best_colocated="colocated_1x2", ratio=1.5, goal=1.4, met=True)
    c = m.compare({"colocated_1x2": fig(None, 5.0), "colocated_2x1": fig(8.0, 4.0), "split": fig(5.6, 7.0)})
    assert c["time_to_gain"]["best_colocated"] == "colocated_2x1" and c["time_to_gain"]["met"]
    assert "time_to_gain" not in m.compare({"colocated_1x2": fig(9.0, 5.0), "split": fig(None, 7.0)})


def test_repeats_are_medians_and_the_gain_needs_every_repeat():
    a = dict(s_per_step=1.0, samples_per_s=10.0, gain=dict(seconds=4.0, step=4), command="x")
    b = dict(s_per_step=3.0, samples_per_s=20.0, gain=dict(seconds=6.0, step=6), command="x")
    med = m.median_of([a, b])
    assert (med["s_per_step"], med["samples_per_s"], med["gain"], med["runs"]) == (2.0, 15.0, dict(seconds=5.0, step=5), 2)
    assert m.median_of([a, dict(b, gain=None)])["gain"] is None


def test_each_layout_takes_each_place_in_the_order():
    names = ["a", "b", "c"]
    assert [m.order(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_every_layout_runs_the_same_job():
    args = bench.build_parser().parse_args(["measure", "--steps", "7", "--batch", "4", "--n", "6", "--seed", "3",
                                            "--staleness", "2", "--set", "trainer.val_every=1"])
    w = m.workloads(args)
    assert [x.name for x in w] == ["tiny", "100m"] and {(x.steps, x.prompts, x.n) for x in w} == {(7, 4, 6)}
    jobs = {name: m.overrides(w[0], layout, args, Path("/m"), Path("/d"), Path("/r")) for name, layout in m.LAYOUTS.items()}
    layout_keys = ("slurm.", "placement.", "async_training.", "actor.micro_batch_size")
    common = [{x for x in over if not x.startswith(layout_keys)} for over in jobs.values()]
    assert common[0] == common[1] == common[2]
    assert {"data.train_batch_size=4", "rollout.n=6", "trainer.total_steps=7", "rollout.engine=vllm",
            "trainer.seed=3", "rollout.seed=3"} <= common[0]
    assert {"slurm.tasks_per_node=1", "slurm.cpus_per_task=2", "actor.micro_batch_size=24"} <= set(jobs["colocated_1x2"])
    assert {"slurm.tasks_per_node=2", "slurm.cpus_per_task=1", "actor.micro_batch_size=12"} <= set(jobs["colocated_2x1"])
    assert {"slurm.tasks_per_node=2", "slurm.cpus_per_task=1", "actor.micro_batch_size=24", "placement.mode=split",
            "placement.rollout_ranks=1", "async_training.staleness=2"} <= set(jobs["split"])
    assert jobs["split"][-1] == "trainer.val_every=1"  # --set comes last: it wins
    m.check_jobs([(w[0], m.LAYOUTS[n], o) for n, o in jobs.items()])  # all valid configs
    quick = m.workloads(bench.build_parser().parse_args(["measure", "--quick"]))
    assert [(x.steps, x.prompts, x.repeats) for x in quick] == [(10, 16, 1), (3, 4, 1)]
    assert [x.repeats for x in m.workloads(bench.build_parser().parse_args(["measure"]))] == [2, 1]


@pytest.mark.parametrize("flags, says", [
    (["--workloads", "tiny,7b"], "--workloads tiny,7b: valid: a comma list of tiny, 100m"),
    (["--layouts", "split"], "--layouts split: valid: split and at least one colocated layout"),
    (["--layouts", "colocated_1x2,colocated_2x1"], "--layouts colocated_1x2,colocated_2x1: valid: split"),
    (["--repeats", "0"], "--repeats 0: valid: >= 1"),
    (["--steps", "3", "--warmup", "3"], "--warmup 3: valid: 0 .. the steps - 1 (2)"),
    (["--staleness", "-1"], "--staleness -1: valid: [0, 64]"),
    (["--gain", "0"], "--gain 0.0: valid: > 0"),
    (["--n", "1"], "measure, tiny / colocated_1x2: rollout.n = 1"),  # the config's own check, before any job
])
def test_bad_flags_are_one_line_errors(flags, says, capsys, tmp_path):
    assert bench.main(["measure", "--out", str(tmp_path), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {says}") and captured.err.count("\n") == 1, captured.err
    assert "[measure]" not in captured.out  # nothing ran


@pytest.mark.heavy
def test_a_failed_job_ends_the_run_with_its_error_line_and_code(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('starting'); print('error: rollout.n: bad', file=sys.stderr); "
                                 "sys.exit(7)"]
    with pytest.raises(m.JobFailed) as err:
        m.run_job(cmd, tmp_path / "run", tmp_path / "run.log", "tiny / split", 3, timeout_s=60)
    assert err.value.exit_code == 7
    assert str(err.value) == f"measure: tiny / split failed (exit 7): error: rollout.n: bad; log: {tmp_path}/run.log"
    with pytest.raises(m.JobFailed, match="ran past --job-timeout 0.5 s") as err:
        m.run_job([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "run", tmp_path / "run.log",
                  "tiny / split", 3, timeout_s=0.5)
    assert err.value.exit_code == 124


def test_measure_prints_the_ratios_and_writes_them(tmp_path, capsys, monkeypatch):
    """The whole command, each job replaced by metrics rows: the split is 1.5x the faster colocated
    layout in samples/s and reaches the gain in 0.6x its training time."""
    import bench_vs_trl

    step_s = {"colocated_1x2": 1.2, "colocated_2x1": 1.0, "split": 0.6}
    ran = []

    def fake_job(cmd, run, log, label, steps, timeout_s):
        name = next(n for n in step_s if f"{n}_r" in run.name)
        ran.append(run.name)
        val = {0: 0.4, 2: 0.5, 4: 0.75} if "tiny" in run.name else {}
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows([9.0] + [step_s[name]] * (steps - 1), val=val)))

    monkeypatch.setattr(m, "run_job", fake_job)
    monkeypatch.setattr(bench_vs_trl, "assets", lambda out, size, sft_steps: out / f"model_{size.name}")
    rc = bench.main(["measure", "--out", str(tmp_path), "--steps", "4", "--repeats", "2"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert len(ran) == 12 and ran[:3] == ["tiny_colocated_1x2_r1", "tiny_colocated_2x1_r1", "tiny_split_r1"]
    assert ran[3:6] == ["tiny_colocated_2x1_r2", "tiny_split_r2", "tiny_colocated_1x2_r2"]  # rotated
    out = json.loads((tmp_path / "measure.json").read_text())
    assert out["command"] == f"python benchmarks/bench_async.py measure --out {tmp_path} --steps 4 --repeats 2"
    tiny, big = out["workloads"]["tiny"]["compare"], out["workloads"]["100m"]["compare"]
    # time to +30 points (step 4): 9 + 3 x step s; samples/s over steps 2..4: 128 / step s
    assert tiny["time_to_gain"]["best_colocated"] == "colocated_2x1"
    assert tiny["time_to_gain"]["ratio"] == pytest.approx((9 + 3 * 0.6) / (9 + 3 * 1.0))
    assert big["samples_per_s"] == dict(best_colocated="colocated_2x1", ratio=pytest.approx(1 / 0.6), goal=1.4, met=True)
    assert "time_to_gain" not in big
    assert "split / best colocated (colocated_2x1), samples/s: 1.67x (goal >= 1.4: met)" in printed
    assert "split / best colocated (colocated_2x1), training time to the gain: 0.90x (goal <= 0.7: not met)" in printed
    assert "[measure] job 12/12: 100m / colocated_1x2 (round 2)" in printed
