"""Plots: one PNG with a panel per metric group that has data; missing groups left out."""
import math

from verl_hpc.tracking import write_plots


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def history(steps=12, with_val=True, with_kl=True):
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "time": 0.0, "reward/score/mean": s / steps, "actor/entropy": 2 - s / steps,
               "response_length/mean": 30.0 + s, "actor/pg_loss": 0.1}
        if with_kl:
            row["actor/kl"] = math.nan if s == 5 else 0.01 * s
        if with_val and s % 4 == 0:
            row["val/acc/synthetic_arith"] = s / steps
        rows.append(row)
    return rows


def read_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    return matplotlib.image.imread(str(path))


def test_all_panels(tmp_path):
    res = write_plots(history(), tmp_path / "plots" / "curves.png", title="p / e")
    assert res.path == tmp_path / "plots" / "curves.png"
    assert res.panels == ["Reward", "Validation accuracy", "KL divergence", "Entropy",
                          "Response length"]
    img = read_png(res.path)
    assert img.shape[0] > 600 and img.shape[1] > 900  # 3 rows x 2 columns of readable panels
    assert img[..., :3].std() > 0.05  # something was drawn, not a blank canvas


def test_missing_groups_are_skipped(tmp_path):
    res = write_plots(history(with_val=False, with_kl=False), tmp_path / "c.png")
    assert res.panels == ["Reward", "Entropy", "Response length"]
    read_png(res.path)


def test_sft_loss_panel(tmp_path):
    rows = [{"step": s, "sft/loss": 3.0 / s, "sft/lr": 1e-3} for s in range(1, 6)]
    assert write_plots(rows, tmp_path / "sft.png").panels == ["SFT loss"]


def test_all_nan_series_and_nothing_to_plot(tmp_path):
    rows = [{"step": 1, "actor/kl": math.nan, "actor/pg_loss": 1.0}]
    assert write_plots(rows, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    assert write_plots([], tmp_path / "none.png") is None
