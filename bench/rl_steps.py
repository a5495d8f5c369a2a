"""Seconds per RL step, strict vs default, measured side by side in one run.

    .venv/bin/python bench/rl_steps.py [--steps 10] [--train megatron] [--infer vllm] [-- extra rl options]

Runs `alignaudit rl` twice on the same model and prompts (default: the fixture), once with every op strict
and once on the default stack, and reads each step's stage timings from steps.parquet. Step 1 is left out
(it includes one-time warm-up). Prints the median seconds per step and per stage for each and the ratio
strict / default; writes bench-rl-steps.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alignaudit.commands import cli  # noqa: E402

STAGES = ["seconds", "rollout_s", "rescore_s", "update_s", "optimizer_s", "sync_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--train", default="megatron")
    parser.add_argument("--infer", default="vllm")
    parser.add_argument("extra", nargs="*", help="more `alignaudit rl` options, after --")
    args = parser.parse_args()
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, strict in (("strict", ["--strict"]), ("default", [])):
            out = Path(tmp) / name
            code = cli.main(["rl", "--train", args.train, "--infer", args.infer, "--steps", str(args.steps),
                             "--no-token-rows", *strict, *args.extra, "--out", str(out)])
            if code != 0:
                raise SystemExit(f"alignaudit rl ({name}) exited with {code}")
            steps = pd.read_parquet(out / "steps.parquet").iloc[1:]
            medians[name] = {stage: float(steps[stage].median()) for stage in STAGES}
            medians[name]["mismatching_steps"] = int((steps["mismatches"] > 0).sum())
    print(f"{'stage':<12}{'strict s':>10}{'default s':>11}{'strict/default':>16}")
    for stage in STAGES:
        s, d = medians["strict"][stage], medians["default"][stage]
        print(f"{stage:<12}{s:>10.3f}{d:>11.3f}{s / d if d else float('nan'):>16.2f}")
    record = {"train": args.train, "infer": args.infer, "steps": args.steps, "median_seconds": medians}
    Path("bench-rl-steps.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
