"""Two or more rl runs overlaid in one PNG (alignaudit.rl.records.plot_runs), e.g. the strict and the default run of
one checkpoint that bench/gpu_run.sh task-rl brings back:

    python bench/plot_rl_runs.py strict=RUN_DIR default=RUN_DIR --out docs/img/rl-....png --title "..."

Each RUN_DIR holds an rl run's steps.parquet and run.json, and its eval.parquet where it scored held-out prompts
(rl --eval-prompts / --eval-every, or the task's own held-out questions): then a panel of the held-out evaluations
comes first. Runs of different checkpoints (model config), prompts
(digest), rollout settings or rl settings other than the strict ops are refused: the picture would compare unlike
runs. Bad input: one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from alignaudit.rl.records import RUNS_PANELS, plot_runs

NEEDED = {column for column, _, _ in RUNS_PANELS} | {"step", "ratio_min", "sync_bit_equal"}


def same_experiment(record: dict) -> dict:
    """What two runs overlaid must share: the model's config, the prompts, the rollout and the rl settings."""
    model = {k: v for k, v in record["model"].items() if k not in ("name", "path")}
    return {"model": model, "prompts": record["prompts"]["digest"], "rollout": record["rollout"], "rl": record["rl"]}


def read_run(parser, name: str, directory: Path) -> tuple[pd.DataFrame, dict]:
    steps, record = directory / "steps.parquet", directory / "run.json"
    if not steps.is_file() or not record.is_file():
        parser.error(f"{name}={directory}: not an rl run directory (steps.parquet and run.json)")
    table = pd.read_parquet(steps)
    missing = sorted(NEEDED - set(table))
    if missing:
        parser.error(f"{name}={directory}: steps.parquet lacks {', '.join(missing)} (an older alignaudit's run?)")
    return table, json.loads(record.read_text())


def read_evals(parser, name: str, path: Path) -> pd.DataFrame:
    """A run's eval.parquet, or one line and exit 2 where it is no table of held-out evaluations."""
    try:
        table = pd.read_parquet(path)
    except Exception as e:  # pyarrow's errors for a file that is not parquet have no common base class
        parser.error(f"{name}={path.parent}: {path.name} is not a readable parquet file ({type(e).__name__})")
    missing = sorted({"step", "reward_mean", "accuracy"} - set(table))
    if missing:
        parser.error(f"{name}={path.parent}: {path.name} lacks {', '.join(missing)} (an older alignaudit's run?)")
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write (its folder must exist)")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    if args.out.suffix != ".png" or not args.out.parent.is_dir():
        parser.error(f"--out {args.out}: a .png path in an existing folder")
    runs, experiments, evals = {}, {}, {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep or not name or name in runs:
            parser.error(f"{item}: write NAME=RUN_DIR with a name of its own per run, e.g. strict=runs/rl-strict")
        runs[name], record = read_run(parser, name, Path(path))
        experiments[name] = same_experiment(record)
        if (Path(path) / "eval.parquet").is_file():
            evals[name] = read_evals(parser, name, Path(path) / "eval.parquet")
    first = next(iter(experiments))
    for name, experiment in experiments.items():
        differing = [key for key in experiment if experiment[key] != experiments[first][key]]
        if differing:
            parser.error(f"{name} and {first} differ in {', '.join(differing)}: not one experiment to overlay")
    plot_runs(runs, args.out, args.title, evals)
    print(args.out)


if __name__ == "__main__":
    main()
