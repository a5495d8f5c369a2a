"""Seconds per RL step, strict vs default, measured side by side in one run.

    .venv/bin/python bench/rl_steps.py [--steps 10] [--train megatron] [--infer vllm] [--configs strict,default]
                                       [--rounds 1] [-- extra rl options]

Runs `alignaudit rl` once per configuration on the same model and prompts (default: the fixture), and reads each step's
stage timings from steps.parquet: "strict" (every op strict, the backward ALIGNAUDIT_BACKWARD's default: fused on CUDA),
"strict-fused" and "strict-reference" (the same with ALIGNAUDIT_BACKWARD set for that run only,
kernels/alignaudit_kernels/gradients.py) and "default" (the default stack). Step 1 is left out of the medians (it
includes one-time warm-up) and printed apart, stage by stage, as each run ends, with that run's medians;
bench-rl-steps.json is written again after each run: a call cut short keeps the runs it finished. Prints the median
seconds per step and per stage for each and each one's ratio to default; writes bench-rl-steps.json (the medians, and
each run's first step). ``--rounds`` N runs the configurations in turn N times and takes the medians over the steps of
all rounds (each round's step ratio printed too): the rollout and the weight sync are host-bound at this shape, and one
run's host can move them (on H100s, the same code gave 1.08 and 1.32; docs/log/gpu-sessions.md, 2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alignaudit.commands import cli  # noqa: E402

STAGES = ["seconds", "rollout_s", "rescore_s", "update_s", "optimizer_s", "sync_s"]
CONFIGS = {
    "strict": (["--strict"], {}),
    "strict-fused": (["--strict"], {"ALIGNAUDIT_BACKWARD": "fused"}),
    "strict-reference": (["--strict"], {"ALIGNAUDIT_BACKWARD": "reference"}),
    "default": ([], {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--train", default="megatron")
    parser.add_argument("--infer", default="vllm")
    parser.add_argument("--configs", default="strict,default", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=1, help="times each configuration runs, in turn")
    parser.add_argument("extra", nargs="*", help="more `alignaudit rl` options, after --")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1 (each round runs every configuration once)")
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (step 1 is left out of the medians)")
    names = args.configs.split(",")
    if "default" not in names or not set(names) <= set(CONFIGS):
        raise SystemExit(f"--configs {args.configs!r}: a comma list of {', '.join(CONFIGS)} with default in it")
    runs = {name: [] for name in names}
    first_steps = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name in names:
                steps = run_once(name, args, Path(tmp) / f"{name}-{i}")
                first_steps[name].append({stage: float(steps[stage].iloc[0]) for stage in STAGES})
                runs[name].append(steps.iloc[1:])
                for label, values in (
                    ("first step", first_steps[name][-1]),
                    ("median of the rest", runs[name][-1][STAGES].median()),
                ):
                    print(
                        f"{name} round {i + 1}, {label}: " + ", ".join(f"{k} {float(values[k]):.3f}" for k in STAGES),
                        flush=True,
                    )
                medians = write_record(args, runs, first_steps)
            if args.rounds > 1:
                ratio = {
                    n: runs[n][-1]["seconds"].median() / runs["default"][-1]["seconds"].median()
                    for n in names
                    if n != "default"
                }
                print(
                    f"round {i + 1}: step / default " + ", ".join(f"{n} {r:.2f}" for n, r in ratio.items()), flush=True
                )
    others = [n for n in names if n != "default"]
    print(f"{'stage':<12}" + "".join(f"{n + ' s':>16}{n + '/default':>22}" for n in others) + f"{'default s':>11}")
    for stage in STAGES:
        d = medians["default"][stage]
        cells = "".join(
            f"{medians[n][stage]:>16.3f}{medians[n][stage] / d if d else float('nan'):>22.2f}" for n in others
        )
        print(f"{stage:<12}{cells}{d:>11.3f}")


def write_record(args, runs: dict, first_steps: dict) -> dict:
    """Write bench-rl-steps.json from the runs finished so far (each after its first step) and return the medians
    per configuration and stage, with each configuration's count of steps with mismatching tokens."""
    medians = {}
    for name, frames in runs.items():
        if frames:
            steps = pd.concat(frames)
            medians[name] = {stage: float(steps[stage].median()) for stage in STAGES}
            medians[name]["mismatching_steps"] = int((steps["mismatches"] > 0).sum())
    record = {
        "train": args.train,
        "infer": args.infer,
        "steps": args.steps,
        "rounds": args.rounds,
        "median_seconds": medians,
        "first_step_seconds": first_steps,
    }
    Path("bench-rl-steps.json").write_text(json.dumps(record, indent=2) + "\n")
    return medians


def run_once(name: str, args, out: Path) -> pd.DataFrame:
    """`alignaudit rl` in configuration ``name`` into ``out``: its steps (steps.parquet rows, the first included)."""
    flags, env = CONFIGS[name]
    os.environ.update(env)  # the engines' worker processes, started by this run, inherit it
    try:
        code = cli.main(
            [
                "rl",
                "--train",
                args.train,
                "--infer",
                args.infer,
                "--steps",
                str(args.steps),
                "--no-token-rows",
                *flags,
                *args.extra,
                "--out",
                str(out),
            ]
        )
    finally:
        for key in env:
            os.environ.pop(key)
    if code != 0:
        raise SystemExit(f"alignaudit rl ({name}) exited with {code}")
    return pd.read_parquet(out / "steps.parquet")


if __name__ == "__main__":
    main()
