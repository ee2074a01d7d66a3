"""The histogram convention: `<prefix>/hist/<int>` scalar keys gathered into one histogram."""
import math

from verl_hpc.tracking.histograms import histogram_metrics, is_hist_key, split_histograms


def test_keys_gathered_per_prefix_with_every_bucket_between():
    metrics = {"reward/mean": 0.5, **histogram_metrics("async/staleness", {0: 812, 2: 3}),
               "x/hist/-1": 1.0, "x/hist/1": 2.0, "notes/hist/latest": 4.0, "hist/3": 5.0}
    scalars, hists = split_histograms(metrics)
    assert scalars == {"reward/mean": 0.5, "notes/hist/latest": 4.0, "hist/3": 5.0}
    stale, x = hists
    assert (stale.name, stale.low, stale.counts) == ("async/staleness/hist", 0, (812.0, 0.0, 3.0))
    assert stale.total == 815 and stale.sum == 6 and stale.sum_squares == 12
    assert stale.filled() == [0, 2] and stale.edges() == [-0.5, 0.5, 1.5, 2.5]
    assert (x.low, x.counts, x.mean) == (-1, (1.0, 0.0, 2.0), 1 / 3)
    assert is_hist_key("async/staleness/hist/12") and not is_hist_key("notes/hist/latest")


def test_nonfinite_counts_are_left_out_of_the_histogram():
    _, (h,) = split_histograms({"a/hist/0": 3.0, "a/hist/1": math.nan})
    assert h.counts == (3.0,)
    assert split_histograms({"a/hist/0": math.inf}) == ({}, [])
    _, (empty,) = split_histograms({"a/hist/0": 0.0})
    assert math.isnan(empty.mean) and empty.filled() == []
