"""Plots: one PNG with a panel per metric group that has data; missing groups left out."""
import math

import pytest

from verl_hpc.tracking import write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def history(steps=12, with_val=True, with_kl=True):
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "time": 0.0, "reward/score/mean": s / steps, "actor/entropy": 2 - s / steps,
               "response_length/mean": 30.0 + s, "actor/pg_loss": 0.1}
        if with_kl:
            row["actor/kl_loss"] = math.nan if s == 5 else 0.01 * s
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
    assert res.panels == ["Reward", "Validation accuracy", "KL to reference", "Entropy",
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
    rows = [{"step": 1, "actor/kl_loss": math.nan, "actor/pg_loss": 1.0}]
    assert write_plots(rows, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    assert write_plots([], tmp_path / "none.png") is None


def _kl_rows(**series):
    """Three steps of the named series (values per step), with the metrics every RL step has."""
    return [{"step": s, "reward/score/mean": 0.5, **{k.replace("__", "/"): v[s - 1] for k, v in series.items()}}
            for s in (1, 2, 3)]


MISMATCH = dict(rollout__logprob_diff_mean=[0.01, 0.02, 0.01], rollout__logprob_diff_max=[0.1, 0.2, 0.1])


def test_kl_panel_shows_the_kl_to_the_reference_where_there_is_one(tmp_path):
    # ppo_kl is 0 by construction on-policy: it is never what the panel shows
    rows = _kl_rows(actor__kl_loss=[0.0, 0.01, 0.02], reward__kl=[0.0, 0.0, 0.0], actor__ppo_kl=[0.0] * 3,
                    **MISMATCH)
    res = write_plots(rows, tmp_path / "c.png")
    assert res.panels == ["Reward", "KL to reference"]
    assert res.series["KL to reference"] == ["actor/kl_loss"]  # reward/kl all 0: left out
    rows = _kl_rows(reward__kl=[0.1, 0.2, 0.3], **MISMATCH)  # KL in the reward (PPO's controller)
    assert write_plots(rows, tmp_path / "c.png").series["KL to reference"] == ["reward/kl"]


def test_kl_panel_shows_the_mismatch_without_a_reference(tmp_path):
    rows = _kl_rows(actor__ppo_kl=[0.0] * 3, **MISMATCH)
    res = write_plots(rows, tmp_path / "c.png")
    assert res.panels == ["Reward", "Rollout/training mismatch"]
    assert res.series["Rollout/training mismatch"] == ["rollout/logprob_diff_mean", "rollout/logprob_diff_max"]


@pytest.mark.parametrize("series", [
    {},  # neither measured
    dict(actor__ppo_kl=[0.0] * 3, actor__kl_loss=[0.0] * 3, reward__kl=[0.0] * 3,
         rollout__logprob_diff_mean=[0.0] * 3, rollout__logprob_diff_max=[0.0] * 3),  # all zero
])
def test_no_kl_panel_when_nothing_was_measured(tmp_path, series):
    res = write_plots(_kl_rows(**series), tmp_path / "c.png")
    assert res.panels == ["Reward"]


def async_rows(steps=8):
    return [{"step": s, "reward/score/mean": s / steps, "async/staleness_mean": 0.5 + 0.1 * s,
             "async/staleness_max": 2.0, "async/idle_frac/rollout": 0.3, "async/idle_frac/train": 0.05,
             "async/tokens_per_s/train": 900.0, "async/staleness/hist/0": 10.0} for s in range(1, steps + 1)]


def test_async_panel_with_async_metrics_and_none_without(tmp_path):
    from verl_hpc.tracking import plots

    res = write_plots(async_rows(), tmp_path / "a.png")
    assert res.panels == ["Reward", "Asynchronous training"]
    assert res.series["Asynchronous training"] == ["async/staleness_mean", "async/staleness_max",
                                                   "async/idle_frac/rollout", "async/idle_frac/train"]
    read_png(res.path)
    idle_only = [{k: v for k, v in r.items() if "staleness" not in k} for r in async_rows()]
    assert write_plots(idle_only, tmp_path / "b.png").series["Asynchronous training"] == [
        "async/idle_frac/rollout", "async/idle_frac/train"]
    # a run without async metrics: the same figure as before
    assert write_plots(history(), tmp_path / "c.png").panels == [
        "Reward", "Validation accuracy", "KL to reference", "Entropy", "Response length"]
    # kept in memory for the plot when there is no metrics.jsonl
    assert plots.wanted("async/idle_frac/train") and plots.wanted("async/staleness_max")


def test_elastic_pool_panel(tmp_path):
    """placement.elastic: the pool's size against the re-dispatched and returned samples."""
    rows = [{"step": s, "time": 0.0, "reward/score/mean": 0.1, "elastic/pool_size": float(min(s, 3)),
             "elastic/redispatched": float(2 * (s > 5)), "elastic/returned": 0.0} for s in range(1, 9)]
    res = write_plots(rows, tmp_path / "e.png")
    assert res.panels == ["Reward", "Elastic rollout pool"]
    assert res.series["Elastic rollout pool"] == ["elastic/pool_size", "elastic/redispatched", "elastic/returned"]
    read_png(res.path)


def test_routing_replay_panel(tmp_path):
    """model.moe_routing_replay: router agreement, mean and per layer."""
    rows = [{"step": s, "time": 0.0, "reward/score/mean": 0.1, "moe/route_agreement": 0.99,
             "moe/route_agreement/layer_0": 1.0, "moe/route_agreement/layer_1": 0.98,
             "rollout/logprob_diff_mean": 2e-7} for s in range(1, 9)]
    res = write_plots(rows, tmp_path / "r.png")
    assert "Routing replay (MoE)" in res.panels
    assert res.series["Routing replay (MoE)"] == ["moe/route_agreement", "moe/route_agreement/layer_0",
                                                 "moe/route_agreement/layer_1"]
    read_png(res.path)


def test_judge_panel(tmp_path):
    """reward.reward_model.kind = judge: verdict rate and agreement with the rule, failures on the right."""
    rows = [{"step": s, "time": 0.0, "reward/score/mean": 0.1, "judge/verdict_rate": 1.0 - 0.1 * (s == 3),
             "judge/agreement": 0.9, "judge/parse_failures": float(s == 3), "judge/timeouts": 0.0,
             "judge/latency_s": 0.1} for s in range(1, 9)]
    res = write_plots(rows, tmp_path / "j.png")
    assert res.panels == ["Reward", "Judge (reward model)"]
    assert res.series["Judge (reward model)"] == ["judge/verdict_rate", "judge/agreement", "judge/parse_failures",
                                                 "judge/timeouts"]
    read_png(res.path)
