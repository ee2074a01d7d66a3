"""Console: a plain progress line with rate and ETA plus an aligned table off a TTY; rich on one."""
import io
import math

import pytest

from verl_hpc.tracking.console import ConsoleBackend, format_value, text_table
from verl_hpc.tracking.progress import StepRate, format_duration, format_rate


METRICS = {"reward/score/mean": 0.532, "actor/pg_loss": -0.012, "actor/kl": math.nan,
           "actor/entropy": 1.23, "response_length/mean": 45.25, "perf/tokens_per_s": 12345.6,
           "perf/tokens_per_s_per_gpu": 3086.4, "timing_s/generate": 1.0, "zzz/other": 7.0}


def test_non_tty_prints_progress_line_and_table(capsys):
    con = ConsoleBackend(total_steps=200, log_every=1)  # stdout is captured: not a TTY
    con.log(METRICS, 1)
    con.log(METRICS, 2)
    con.close()
    out = capsys.readouterr().out
    assert "\x1b[" not in out and "\r" not in out  # no control characters in a Slurm log
    lines = out.splitlines()
    assert lines[0].startswith("step 1/200 (0%) ") and " s/step ETA " in lines[0]
    progress = [ln for ln in lines if ln.startswith("step 2/200 (1%) ")]
    assert len(progress) == 1 and "ETA" in progress[0]
    table = "\n".join(lines[1:lines.index(progress[0])])
    for name in ("reward/score/mean", "actor/pg_loss", "actor/kl", "actor/entropy",
                 "response_length/mean", "perf/tokens_per_s"):
        assert name in table
    assert "nan" in table  # a non-finite value is shown, not hidden
    # only the chosen keys: not everything that was logged
    assert "zzz/other" not in table and "timing_s/generate" not in table
    assert "tokens_per_s_per_gpu" not in table
    assert table.index("reward/score/mean") < table.index("actor/pg_loss")


def test_console_metrics_adds_keys_after_the_default_ones(capsys):
    con = ConsoleBackend(total_steps=5, extra=["zzz/other", "timing_s/"])
    con.log(METRICS, 1)
    con.close()
    out = capsys.readouterr().out
    assert "zzz/other" in out and "timing_s/generate" in out
    assert out.index("reward/score/mean") < out.index("zzz/other") < out.index("timing_s/generate")


def test_log_every_first_last_and_validation_steps(capsys):
    con = ConsoleBackend(total_steps=10, log_every=4)
    for step in range(1, 11):
        con.log({"reward/mean": 0.1, **({"val/acc/arith": 0.5} if step == 3 else {})}, step)
    printed = [int(ln.split()[1].split("/")[0]) for ln in capsys.readouterr().out.splitlines()
               if ln.startswith("step ")]
    assert printed == [1, 3, 4, 8, 10]


def test_rate_and_eta_from_recent_steps():
    t = [0.0]
    rate = StepRate(total_steps=200, clock=lambda: t[0])
    t[0] = 30.0
    rate.update(1)              # the first step carries warm-up: 30 s
    assert rate.seconds_per_step() == 30.0
    for step in range(2, 13):
        t[0] += 3.4
        rate.update(step)
    assert rate.seconds_per_step() == pytest.approx(3.4)  # warm-up left out
    rate.update(12)             # the same step again (validation) is not progress
    assert rate.line() == "step 12/200 (6%) 3.4 s/step ETA 10m39s"


def test_formats():
    assert [format_duration(s) for s in (0, 38, 638, 7500, 2 * 86400 + 3 * 3600)] == [
        "0s", "38s", "10m38s", "2h05m", "2d03h"]
    assert format_duration(math.nan) == "?"
    assert format_rate(3.44) == "3.4 s/step" and format_rate(0.0123) == "0.012 s/step"
    assert format_rate(42.0) == "42 s/step"
    assert [format_value(v) for v in (0.0, 0.532, -0.012, 12345.6, 1e-5, math.inf)] == [
        "0", "0.532", "-0.012", "12,346", "1.00e-05", "inf"]


def test_text_table_columns_line_up():
    rows = text_table([("a", "1"), ("reward/mean", "0.5"), ("c", "-2"),
                       ("response_length/mean", "45.25"), ("e", "3"), ("f", "1,234")])
    assert len(rows) == 2 and len(rows[0]) == len(rows[1])
    # values are right-aligned at the same columns whatever the names and numbers are
    assert rows[0].index("1 ") == rows[1].index("45.25") + 4
    assert rows[0].index("reward/mean") == rows[1].index("e ")
    assert rows[0].endswith("-2") and rows[1].endswith("1,234")


def test_rich_mode_on_a_terminal_renders_table_and_bar():
    buf = io.StringIO()
    con = ConsoleBackend(total_steps=5, stream=buf, tty=True)
    for step in range(1, 6):
        con.log(METRICS, step)
    con.note("plots: /x.png")
    con.close()
    out = buf.getvalue()
    assert "reward/score/mean" in out and "step 5/5" in out and "plots: /x.png" in out


def test_eta_from_the_reported_step_times_leaves_validation_out():
    """Steps of 2 s with a 40 s validation after step 5: the wall time between log() calls has it,
    the trainer's timing_s/step does not, and the ETA follows the latter."""
    t = [0.0]
    rate = StepRate(total_steps=100, clock=lambda: t[0])
    t[0] = 30.0
    rate.update(1, seconds=30.0)  # warm-up
    for step in range(2, 11):
        t[0] += 2.0 + (40.0 if step == 6 else 0.0)
        rate.update(step, seconds=2.0)
    assert rate.seconds_per_step() == 2.0
    assert rate.eta_seconds() == 180.0


def test_console_passes_the_step_time_to_the_rate(capsys):
    from verl_hpc.tracking.console import ConsoleBackend

    con = ConsoleBackend(total_steps=10, tty=False)
    con.log({"timing_s/step": 30.0}, 1)
    con.log({"timing_s/step": 1.5, "timing_s/validation": 9.0}, 2)
    assert con.rate.seconds_per_step() == 1.5


STALE = {"reward/score/mean": 0.5, "async/staleness/hist/0": 812.0, "async/staleness/hist/1": 40.0,
         "async/staleness/hist/2": 3.0}


def test_histogram_is_one_summary_line_not_a_cell_per_bucket(capsys):
    con = ConsoleBackend(total_steps=5)
    con.log(STALE, 1)
    con.log({**STALE, **{f"async/staleness/hist/{d}": 1.0 for d in range(3, 12)}}, 2)
    con.close()
    lines = capsys.readouterr().out.splitlines()
    hist = [ln.strip() for ln in lines if "async/staleness" in ln]
    assert hist[0] == "async/staleness/hist  n=855  mean=0.0538  max=2  | 0:812 1:40 2:3"
    # the line stays one line when many buckets are filled: the first 8 and a count of the rest
    assert hist[1].endswith("| 0:812 1:40 2:3 3:1 4:1 5:1 6:1 7:1 +4 more") and " max=11 " in hist[1]
    assert len(hist) == 2 and "reward/score/mean" in lines[1]


def test_histogram_line_on_a_terminal_and_only_for_chosen_prefixes():
    buf = io.StringIO()
    con = ConsoleBackend(total_steps=5, stream=buf, tty=True)
    con.log({**STALE, "other/hist/0": 7.0}, 1)
    con.close()
    out = buf.getvalue()
    assert "async/staleness/hist  n=855" in out and "hist/0" not in out
    assert "other/hist" not in out  # not among the console's metrics (tracking.console_metrics adds it)
