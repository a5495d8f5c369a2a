"""Where the seconds of one RL update go, strict vs default, measured side by side in one run.

    python bench/train_step_profile.py [--model Qwen3-1.7B] [--device cuda] [--sequences 32] [--prompt-len 64]
                                      [--new-tokens 64] [--kl-coef 0.04] [--rounds 2] [--json FILE]

For each of strict and default, in its own process (megatron.core's parallel state is per process): the
trainer of `alignaudit rl` (alignaudit.workers.rl_session.Worker, megatron, random weights) on one batch of random
token ids, the shape `alignaudit rl` feeds it (sequences x (prompt + new tokens)); two warm-up updates, five
timed (the median of ``train_step``'s wall seconds and of its optimizer step), then one under torch.profiler:
the kernels and ops with the most self time, how many kernels the update launched, and on CUDA the host side:
the GPU's busy and idle seconds in the profiled update, the calls that wait for the GPU, the host ops with the
most self CPU time. Prints the median
update seconds of both and the ratio strict / default; --json writes every number.

Rounds: strict and default alternate, one process each a round (``--rounds``), and the ratio reported is the median
of the rounds' ratios. The update is host-bound at this shape, and one process's wall time moved with the host: on
an H100 three runs of the same code gave 1.31, 1.27 and 1.03 with the same kernel time (docs/log/gpu-sessions.md, eighth
session), so one round is not a measurement of the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOP = 18


def profile_one(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from alignaudit.inputs.checkpoint import find_preset, resolve_model
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.workers.rl_session import Worker

    spec = resolve_model(args.model, random_weights=find_preset(args.model) is not None)  # presets: random weights
    settings = EngineSettings(device=args.device, strict="all" if args.mode == "strict" else "")
    worker = Worker(
        {
            "role": "trainer",
            "engine": "megatron",
            "spec": spec.to_dict(),
            "settings": settings.to_dict(),
            "lr": 1e-6,
            "clip_grad": 1.0,
            "kl_coef": args.kl_coef,
        }
    )
    gen = torch.Generator().manual_seed(0)
    length = args.prompt_len + args.new_tokens
    sequences = torch.randint(0, spec.vocab_size, (args.sequences, length), generator=gen).tolist()
    scored = worker.handle("score", {"sequences": sequences})["logprobs"]
    step = {
        "prompt_lengths": [args.prompt_len] * args.sequences,
        "advantages": [(-1.0) ** i for i in range(args.sequences)],
        "rollout_logprobs": [lp[args.prompt_len - 1 :] for lp in scored],
        "clip_eps": 0.2,
        "replay": None,
    }

    def update() -> tuple[float, float]:
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        reply = worker.handle("train_step", {"sequences": sequences, **step})
        sync()
        return time.perf_counter() - t0, reply["optimizer_s"]

    for _ in range(2):
        update()
    timed = [update() for _ in range(5)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled_wall_s, _ = update()
    events = prof.key_averages()
    on_device = args.device == "cuda"
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:TOP]
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in prof.events() if on_device and getattr(e, "device_type", None) == cuda]
    return {
        "mode": args.mode,
        "model": args.model,
        "device": args.device,
        "tokens": args.sequences * length,
        "kl_coef": args.kl_coef,
        "update_s": statistics.median(t for t, _ in timed),
        "optimizer_s": statistics.median(o for _, o in timed),
        "kernels_launched": len(kernels),
        "kernel_s": round(sum(e.device_time_total for e in kernels) / 1e6, 3) if kernels else None,
        "top": [{"name": e.key[:90], "calls": e.count, "self_ms": round(getattr(e, key, 0) / 1e3, 2)} for e in rows],
        **(host_side(prof, events, kernels, profiled_wall_s) if on_device else {}),
    }


def host_side(prof, events, kernels, wall_s: float) -> dict:
    """Where an update's wall time is not kernel time: the GPU's busy seconds (bench/timing.gpu_timeline), the idle
    rest and its gaps by length, and bench/timing.host_table (the calls that wait for the GPU, the host ops with the
    most self CPU time)."""
    from bench.timing import gpu_timeline, host_table

    timeline = gpu_timeline([(e.time_range.start, e.time_range.end) for e in kernels])
    busy_s = timeline["busy_ms"] / 1e3
    return {
        "profiled_wall_s": round(wall_s, 4),
        "gpu_busy_s": round(busy_s, 4),
        "gpu_idle_s": round(wall_s - busy_s, 4),
        "gaps": timeline["gaps"],
        **host_table(events, TOP),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen3-1.7B")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kl-coef", type=float, default=0.04)
    parser.add_argument("--rounds", type=int, default=2, help="strict and default processes, alternating")
    parser.add_argument("--json")
    parser.add_argument("--mode", choices=["strict", "default"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1 (each round runs every configuration once)")
    if args.mode:
        print(json.dumps(profile_one(args)))
        return
    rounds = []
    argv = [a for a in sys.argv[1:] if a != "--json" and a != args.json]
    for i in range(args.rounds):
        results = {}
        for mode in ("strict", "default"):
            child = subprocess.run([sys.executable, __file__, *argv, "--mode", mode], capture_output=True, text=True)
            if child.returncode != 0:
                raise SystemExit(f"{mode} run failed ({child.returncode}):\n{child.stderr[-3000:]}")
            results[mode] = json.loads(child.stdout.strip().splitlines()[-1])
            if i == 0:
                show(mode, results[mode])
        s, d = results["strict"]["update_s"], results["default"]["update_s"]
        print(f"round {i + 1}: update strict {s:.3f} s, default {d:.3f} s, strict/default {s / d:.2f}", flush=True)
        rounds.append(results)
    ratio = statistics.median(r["strict"]["update_s"] / r["default"]["update_s"] for r in rounds)
    print(f"update: strict/default {ratio:.2f} (median of {len(rounds)} rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "median_ratio": round(ratio, 4)}, indent=2) + "\n")


def show(mode: str, r: dict) -> None:
    """Print one process's update: its seconds, busiest kernels and, on CUDA, its host side."""
    print(
        f"== {mode}: update {r['update_s']:.3f} s (optimizer {r['optimizer_s']:.3f}), "
        f"{r['kernels_launched']} kernels, {r['kernel_s']} s of kernel time, {r['tokens']} tokens"
    )
    for row in r["top"]:
        print(f"   {row['self_ms']:>9.2f} ms {row['calls']:>6}x  {row['name']}")
    if "gpu_busy_s" in r:
        print(
            f"   profiled update {r['profiled_wall_s']} s: GPU busy {r['gpu_busy_s']} s, "
            f"idle {r['gpu_idle_s']} s (gaps {r['gaps']}); "
            f"synchronizing calls {r['synchronizing_calls']}; host self time:"
        )
        for row in r["host_top"][:10]:
            print(f"   {row['self_cpu_ms']:>9.2f} ms {row['calls']:>6}x  {row['name']}")


if __name__ == "__main__":
    main()
