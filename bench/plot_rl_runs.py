"""Two or more rl runs' steps.parquet overlaid in one PNG (alignaudit.rl.records.plot_runs), e.g. the strict and
the default run of one checkpoint that bench/gpu_run.sh task-rl brings back:

    python bench/plot_rl_runs.py strict=task-strict-steps.parquet default=task-default-steps.parquet \
        --out docs/img/rl-gpu-task-strict-vs-default-200.png --title "..."
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from alignaudit.rl.records import plot_runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", metavar="NAME=STEPS_PARQUET")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep:
            parser.error(f"{item}: write NAME=STEPS_PARQUET, e.g. strict=run/steps.parquet")
        runs[name] = pd.read_parquet(path)
    plot_runs(runs, args.out, args.title)
    print(args.out)


if __name__ == "__main__":
    main()
