"""PNG training curves from the metrics history: reward, validation accuracy, KL to the reference
(or, without one, the rollout/training mismatch), entropy, length, and with data.tasks the reward
and weight of each task, and for an asynchronous run (split placement) the staleness of the
trained tokens and how much of its time each group spent waiting on the other.

One figure, one panel per group, step on x. A group with no matching metric is left out rather
than drawn empty, so an SFT run or a run without validation still gets a clean figure. The KL
panel shows only what was measured: actor/ppo_kl (KL to the policy before the update) is 0 by
construction on the on-policy path and a run at KL coefficient 0 has no reference, so it plots
the KL to the reference where the run has one (the KL loss, or the KL in the reward) and else
the rollout engine's log-prob gap to the trainer's; a series that is 0 at every step says
nothing and is dropped, and a panel left with none is not drawn.

Drawn with matplotlib's object API on an Agg canvas, not pyplot: pyplot keeps global figures and
picks a GUI backend from the environment, neither of which a batch job or a caller wants touched.
"""
from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

MAX_LINES = 6  # per panel; past that a legend stops being readable


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    patterns: tuple[str, ...]  # fnmatch patterns, in legend order
    ylim: tuple[float, float] | None = None  # fixed axis where the quantity has a natural range
    drop_zeros: bool = False  # leave out series that are 0 at every step (zero by construction)
    instead: Panel | None = None  # drawn in this one's place when this one has no series
    # series on a second y axis at the right, for a quantity in other units drawn beside the first
    right: tuple[str, ...] = ()
    right_ylabel: str = ""
    right_ylim: tuple[float, float] | None = None


PANELS: tuple[Panel, ...] = (
    Panel("Reward", "reward", ("reward/score/mean", "val/reward/*")),
    Panel("Validation accuracy", "accuracy", ("val/acc", "val/acc/*"), ylim=(-0.02, 1.02)),
    Panel("KL to reference", "KL(policy || ref) (nats/token)", ("actor/kl_loss", "reward/kl"), drop_zeros=True,
          instead=Panel("Rollout/training mismatch", "|rollout - trainer| log-prob (nats)",
                        ("rollout/logprob_diff_mean", "rollout/logprob_diff_max"), drop_zeros=True)),
    Panel("Entropy", "entropy (nats/token)", ("actor/entropy", "*/entropy")),
    Panel("Response length", "tokens", ("response_length/mean", "response_length/max")),
    # PRIME: how well the implicit PRM predicts the step's outcome labels before it learns from them
    # (0.5 AUC = chance) against its loss, and the spread of its token rewards
    Panel("Implicit PRM", "accuracy / AUC on the outcome labels", ("prm/acc", "prm/auc", "prm/group_auc"), ylim=(-0.02, 1.02),
          right=("prm/ce_loss", "prm/pairwise_loss"), right_ylabel="PRM loss"),
    Panel("Process rewards", "reward per token", ("prm/token_reward_mean", "prm/token_reward_std"),
          right=("filter/acc_filtered_share",), right_ylabel="share of groups outside the accuracy band",
          right_ylim=(-0.02, 1.02)),
    # on-policy distillation: the student's reverse KL to the teacher on its own samples
    Panel("Distillation", "KL(student || teacher) (nats/token)", ("teacher/kl",)),
    # a generative judge (reward.reward_model.kind = judge): the share of responses it gave a verdict
    # and how often it agrees with the rule where the task has one, against the responses it failed
    # (a judge that is being gamed shows as agreement falling while the reward climbs)
    Panel("Judge (reward model)", "share of the step's responses", ("judge/verdict_rate", "judge/agreement"),
          ylim=(-0.02, 1.02), right=("judge/parse_failures", "judge/timeouts"),
          right_ylabel="responses without a verdict"),
    Panel("SFT loss", "cross-entropy (nats/token)", ("sft/loss",)),
    Panel("Reward per task", "reward", ("task/*/reward", "val/task/*/reward")),  # data.tasks
    Panel("Task weights", "weight", ("task/*/weight",)),  # data.task_weights: what each step drew with
    # async_training: staleness in policy versions (0..k) against idle shares (0..1), on one panel
    # so that a rise in one can be read against the other at the same step
    Panel("Asynchronous training", "staleness (policy versions)", ("async/staleness_mean", "async/staleness_max"),
          right=("async/idle_frac/rollout", "async/idle_frac/train"),
          right_ylabel="idle fraction (waiting on the other group)", right_ylim=(-0.02, 1.02)),
    # multi_turn: how often episodes call a tool (training samples and greedy validation) against
    # the share of calls that failed, so a rising call rate can be read against its errors
    Panel("Tool use", "share of episodes calling a tool", ("episode/tool_call_rate", "val/episode/tool_call_rate"),
          ylim=(-0.02, 1.02), right=("episode/tool_error_rate",), right_ylabel="failed share of calls",
          right_ylim=(-0.02, 1.02)),
    # placement.elastic: the rollout pool's size against the samples re-dispatched (stragglers,
    # workers lost), so a shrinking pool can be read against the work it cost
    Panel("Elastic rollout pool", "joined workers", ("elastic/pool_size",),
          right=("elastic/redispatched", "elastic/returned"), right_ylabel="samples re-dispatched / returned"),
    # mixture-of-experts actors: how unevenly the routers load the experts (1 = even) against the
    # router's load-balancing loss and the share of token-expert assignments dropped by capacity
    Panel("Expert load (MoE)", "max / mean expert load", ("actor/moe/load_imbalance", "actor/moe/layer_*/load_imbalance"),
          right=("actor/moe/aux_loss", "actor/moe/dropped_fraction"), right_ylabel="aux loss / dropped share"),
    # routing replay (model.moe_routing_replay): the share of replayed (token, expert slot) pairs the
    # training router would have chosen itself (rollout: in the old-log-prob forward; old: in the
    # update); the log-prob gap left is the mismatch panel's (drawn where there is no reference KL)
    Panel("Routing replay (MoE)", "router agreement (replayed vs own top-k)",
          ("moe/route_agreement", "actor/moe/route_agreement", "moe/route_agreement/layer_*",
           "actor/moe/route_agreement/layer_*")),
)
# What the tracker keeps in memory when there is no JSONL file to read back.
def _alternatives(panel: Panel | None):
    while panel is not None:
        yield panel
        panel = panel.instead


PLOT_PATTERNS: tuple[str, ...] = tuple(p for panel in PANELS for alt in _alternatives(panel)
                                       for p in alt.patterns + alt.right)


@dataclass
class PlotResult:
    path: Path
    panels: list[str] = field(default_factory=list)
    series: dict[str, list[str]] = field(default_factory=dict)  # panel title -> the metrics it draws


def wanted(name: str, patterns: Iterable[str] = PLOT_PATTERNS) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _series(history: Sequence[dict[str, Any]], patterns: Sequence[str], drop_zeros: bool = False):
    """{name: (steps, values)} for names matching the patterns, in pattern order, steps sorted;
    a series with no finite value (or, with drop_zeros, no nonzero one) is left out."""
    keys = dict.fromkeys(k for row in history for k in row)  # ordered union over all rows
    names: list[str] = []
    for pattern in patterns:
        names += [k for k in keys if k not in names and fnmatch.fnmatchcase(k, pattern)]
    out = {}
    for name in names[:MAX_LINES]:
        points = sorted((row["step"], row[name]) for row in history
                        if name in row and isinstance(row[name], (int, float)))
        if any(math.isfinite(v) and (v != 0 or not drop_zeros) for _, v in points):
            out[name] = ([s for s, _ in points], [float(v) for _, v in points])
    return out


def _first_with_data(history, panel: Panel):
    """(the panel, its series, its right-axis series), or its `instead`'s where it has none; None
    when no alternative has any."""
    for alt in _alternatives(panel):
        series = _series(history, alt.patterns, alt.drop_zeros)
        right = _series(history, alt.right, alt.drop_zeros) if alt.right else {}
        if series or right:
            return alt, series, right
    return None


def _draw(ax, series, first_colour: int = 0, **style) -> None:
    for i, (name, (steps, values)) in enumerate(series.items()):
        sparse = name.startswith("val/") or len(steps) <= 30  # a few points: show each one
        # "CN": the Nth colour of the style's cycle, named so a twin axis can go on from the first's
        ax.plot(steps, values, label=name, marker="o" if sparse else None, markersize=3,
                linewidth=1.4, color=f"C{first_colour + i}", **style)


def _draw_right(ax, panel: Panel, series) -> None:
    """The right-axis series, dashed and in colours after the left ones; one legend for both."""
    twin = ax.twinx()
    _draw(twin, series, first_colour=len(ax.get_lines()), linestyle="--")
    twin.set_ylabel(panel.right_ylabel)
    if panel.right_ylim is not None:
        twin.set_ylim(*panel.right_ylim)
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize="small", loc="best")


def write_plots(history: Sequence[dict[str, Any]], path: str | os.PathLike,
                title: str = "", panels: Sequence[Panel] = PANELS) -> PlotResult | None:
    """Draw the panels that have data into one PNG at `path`; None when there is nothing to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawn = [d for p in panels if (d := _first_with_data(history, p))]
    if not drawn:
        return None
    cols = 1 if len(drawn) == 1 else 2
    rows = math.ceil(len(drawn) / cols)
    fig = Figure(figsize=(6.0 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (panel, series, right) in zip(axes, drawn):
        _draw(ax, series)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        if right:
            _draw_right(ax, panel, right)
        else:
            ax.legend(fontsize="small", loc="best")
    for ax in axes[len(drawn):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return PlotResult(path=path, panels=[p.title for p, _, _ in drawn],
                      series={p.title: list(s) + list(r) for p, s, r in drawn})


def write_comparison(runs: dict[str, Sequence[dict[str, Any]]], metric: str, path: str | os.PathLike,
                     title: str = "", ylabel: str = "", ylim: tuple[float, float] | None = (-0.02, 1.02),
                     hlines: dict[str, float] | None = None) -> Path:
    """One panel: `metric` of several runs against step (label -> that run's history), e.g. the
    validation accuracy of two algorithms trained with the same seeds and steps; `hlines` (label ->
    value): dashed reference levels, e.g. a distillation teacher's accuracy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.5, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, (label, history) in enumerate(runs.items()):
        points = _series(history, (metric,)).get(metric)
        if points:
            ax.plot(*points, label=label, marker="o", markersize=3, linewidth=1.4, color=f"C{i}")
    for j, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, label=label, linestyle="--", linewidth=1.2, color=f"C{len(runs) + j}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel or metric)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    ax.set_title(title or metric)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
