"""The RL run's picture: the per-step series of steps.parquet in one PNG (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def plot_steps(steps: pd.DataFrame, path: Path, evals: pd.DataFrame | None = None, title: str = "") -> None:
    """Six panels over the steps: mismatching-token fraction; max |d logprob| (log scale); K3 KL and the
    clip fraction of the ratio; reward and loss, with the held-out evaluations (``evals``, eval.parquet's table:
    their greedy reward and, under the task, accuracy, at the step after which each ran; 0 is before the first); the
    grad norm; the fraction of weight elements the update changed (log scale; older runs without the column leave it
    empty). A step with no mismatch plots as 0 (and is absent from the log-scale panels, which say so when no step is
    left)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex=True)
    x = steps["step"]
    ax = axes[0, 0]
    ax.plot(x, steps["mismatch_fraction"], marker=".")
    ax.set_ylabel("mismatching tokens (fraction)")
    ax.set_ylim(bottom=0)
    ax = axes[0, 1]
    positive = steps[steps["max_abs_diff"] > 0]
    ax.plot(positive["step"], positive["max_abs_diff"], marker=".", color="tab:red")
    if len(positive):
        ax.set_yscale("log")
    else:
        ax.text(
            0.5,
            0.5,
            "0 at every step: the logprobs agree bit for bit",
            transform=ax.transAxes,
            ha="center",
            va="center",
        )
        ax.set_yticks([])
    ax.set_ylabel("max |lp_train - lp_rollout|")
    ax = axes[1, 0]
    ax.plot(x, steps["kl_k3"], marker=".", label="KL k3 (rollout || train)")
    ax.plot(x, steps["clip_fraction"], marker=".", label="ratio outside clip")
    ax.set_ylabel("per token")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[1, 1]
    ax.plot(x, steps["reward_mean"], marker=".", color="tab:green", label="reward")
    if evals is not None and len(evals):
        ax.plot(evals["step"], evals["reward_mean"], marker="s", color="tab:blue", label="held-out reward (greedy)")
        if evals["accuracy"].notna().any():
            ax.plot(
                evals["step"],
                evals["accuracy"],
                marker="^",
                linestyle="--",
                color="tab:cyan",
                label="held-out accuracy",
            )
    ax.set_ylabel("reward (mean)")
    twin = ax.twinx()
    twin.plot(x, steps["loss"], marker=".", color="tab:gray", alpha=0.6, label="loss (right axis)")
    twin.set_ylabel("loss")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=8)
    ax = axes[2, 0]
    ax.plot(x, steps["grad_norm"], marker=".", color="tab:purple")
    ax.set_ylabel("grad norm (before clipping)")
    ax.set_ylim(bottom=0, top=max(1e-9, float(steps["grad_norm"].max())) * 1.08)
    ax = axes[2, 1]
    if "weights_changed_fraction" in steps:
        moved = steps[steps["weights_changed_fraction"] > 0]
        ax.plot(moved["step"], moved["weights_changed_fraction"], marker=".", color="tab:brown")
        if len(moved):
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no weight element changed", transform=ax.transAxes, ha="center", va="center")
            ax.set_yticks([])
    ax.set_ylabel("weight elements changed (fraction)")
    from matplotlib.ticker import MaxNLocator

    for ax in axes[2]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    synced = bool(steps["sync_bit_equal"].all())
    fig.suptitle(f"{title}\nweight sync bit-equal at every step: {'yes' if synced else 'NO'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# (column, panel title, log scale): what the strict-vs-default picture shows, per step, for every run
RUNS_PANELS = (
    ("reward_mean", "reward (mean over the step's completions)", False),
    ("mismatch_fraction", "mismatching tokens (fraction)", False),
    ("max_abs_diff", "max |lp_train - lp_rollout|", True),
    ("kl_k3", "KL k3 (rollout || train), per token", True),
    ("is_geo_mask_fraction", "sequences the geometric mask [0.999, 1.001] drops", False),
    ("ratio_max", "importance ratio: max (solid) and min (dashed)", False),
)


def plot_runs(
    runs: dict[str, pd.DataFrame], path: Path, title: str = "", evals: dict[str, pd.DataFrame] | None = None
) -> None:
    """``runs_figure(runs, title, evals)`` saved as a PNG at ``path`` (1100 x 1000 pixels; 1100 x 1300 with the
    held-out panel).

    Raises:
        KeyError: as runs_figure."""
    import matplotlib.pyplot as plt

    fig = runs_figure(runs, title, evals)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def runs_figure(runs: dict[str, pd.DataFrame], title: str = "", evals: dict[str, pd.DataFrame] | None = None):
    """Several rl runs' steps.parquet tables overlaid, one line per run, in six panels (``RUNS_PANELS``): the
    reward; the mismatching-token fraction; max |d logprob| and the k3 KL (log scale; a run that is 0 at every
    step is named in the panel instead, since 0 has no place on a log axis); the share of sequences the
    geometric-mean sequence mask would drop; the importance ratio's max and min. With ``evals`` (run name ->
    its eval.parquet table, for the runs that have one) a seventh panel first: the held-out prompts' headline
    (alignaudit.comparison.held_out.headline: greedy accuracy under the task, else the greedy reward) at the step
    after which each evaluation ran (0: before the first). Made for a strict and a default run from one checkpoint
    (docs/log/findings.md, issues [26] and [32]). Returns the matplotlib Figure (Agg backend); the caller closes it.

    Raises:
        KeyError: a table without one of the columns (steps.parquet of an older alignaudit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    evals = {name: table for name, table in (evals or {}).items() if len(table)}
    rows = 4 if evals else 3
    fig, axes = plt.subplots(rows, 2, figsize=(11, 10 if rows == 3 else 13), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = list(axes.flat)
    if evals:
        _held_out_panel(panels.pop(0), runs, evals, colors)
        panels.pop().set_visible(False)  # seven panels on a grid of eight
    for ax, (column, label, log) in zip(panels, RUNS_PANELS, strict=True):
        zero_runs = []
        for i, (name, steps) in enumerate(runs.items()):
            color = colors[i % len(colors)]
            shown = steps[steps[column] > 0] if log else steps
            if log and not len(shown):
                zero_runs.append(name)
                continue
            ax.plot(shown["step"], shown[column], color=color, label=name, linewidth=1)
            if column == "ratio_max":
                ax.plot(steps["step"], steps["ratio_min"], color=color, linestyle="--", linewidth=1)
        if log and len(zero_runs) < len(runs):
            ax.set_yscale("log")
        if zero_runs:
            _panel_note(ax, f"{', '.join(zero_runs)}: 0 at every step")
        ax.set_title(label, fontsize=9)
        if ax.get_lines():  # a log panel where every run is 0 has no line, only the note
            ax.legend(loc="best", fontsize=8)
    for ax in (axes[-1, 0], axes[-1, 1] if not evals else axes[-2, 1]):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_tick_params(labelbottom=True)
    synced = {name: "yes" if bool(steps["sync_bit_equal"].all()) else "NO" for name, steps in runs.items()}
    sync = f"weight sync bit-equal at every step: {', '.join(f'{name} {s}' for name, s in synced.items())}"
    fig.suptitle(f"{title}\n{sync}" if title else sync, fontsize=10)
    fig.tight_layout()
    return fig


def _held_out_panel(ax, runs: dict[str, pd.DataFrame], evals: dict[str, pd.DataFrame], colors) -> None:
    """The held-out evaluations of each run that has them, in the run's color, each run with a marker and a line
    style of its own (two runs with equal values stay visible); the runs without any are named in the panel."""
    from alignaudit.comparison.held_out import headline

    measures, missing = set(), []
    for i, name in enumerate(runs):
        if name not in evals:
            missing.append(name)
            continue
        table = evals[name]
        measure = headline(table)
        measures.add(measure)
        ax.plot(
            table["step"],
            table[measure],
            color=colors[i % len(colors)],
            marker="osD^v"[i % 5],
            markersize=6 - i % 3,
            linestyle=("-", "--", ":", "-.")[i % 4],
            linewidth=1,
            label=name,
        )
    named = {"accuracy": "held-out accuracy (greedy)", "reward_mean": "held-out reward (greedy)"}
    ax.set_title(" / ".join(named[m] for m in sorted(measures)), fontsize=9)
    if missing:
        _panel_note(ax, f"{', '.join(missing)}: no held-out evaluation")
    ax.legend(loc="best", fontsize=8)


def _panel_note(ax, text: str) -> None:
    """A note in a panel's lower left corner, over the lines (runs_figure: what a panel does not draw)."""
    ax.text(
        0.02,
        0.04,
        text,
        transform=ax.transAxes,
        ha="left",
        va="bottom",
        bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"},
    )
