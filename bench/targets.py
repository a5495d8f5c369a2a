"""Issue [19]'s targets from one GPU run's records: measured ratio, target, met or missed.

    python3 bench/targets.py --kernels bench.json [--forward forward.json] [--vllm vllm.json]

Reads what bench/kernels_gpu.py (--sections matmul,attention-fa3 --json), bench/forward_gpu.py (--json) and
bench/vllm_generate.py (--json) wrote in the same run and prints one line per target: ratios are throughput
ratios (strict / reference speed, > 1 strict faster), graph replays where the target says so. Nothing is
timed here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def kernel_lines(rows):
    for r in rows:
        if r.get("target") == "prefill":
            need = 0.8 if r["tokens"] >= 4096 else 0.7
            yield (
                f"prefill {r['tokens']} {r['exp']} exp vs FA3 (eager / graph)",
                r["ratio"],
                r.get("graph_ratio"),
                need,
                max(r["ratio"], r.get("graph_ratio") or 0) >= need,
            )
        elif r.get("target") == "decode":
            ratio = r.get("graph_ratio") or 0
            yield f"paged decode b={r['batch']} ctx 4096 {r['exp']} exp vs FA3 (graph)", None, ratio, 0.7, ratio >= 0.7
        elif "layer" in r and r["layer"] != "lm_head":
            need = 0.95 if r["M"] >= 4096 else 0.9
            yield (
                f"linear {r['layer']} M={r['M']} vs cuBLAS (graph)",
                r["ratio"],
                r.get("graph_ratio"),
                need,
                (r.get("graph_ratio") or 0) >= need,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", type=Path, action="append", default=[])
    parser.add_argument("--forward", type=Path)
    parser.add_argument("--vllm", type=Path)
    args = parser.parse_args()
    lines = []
    for path in args.kernels:
        lines += list(kernel_lines(json.loads(path.read_text())["rows"]))
    if args.forward and args.forward.is_file():
        f = json.loads(args.forward.read_text())
        if f.get("strict_compiled_ms"):
            t = f["strict_compiled_ms"] / f["default_compiled_ms"]
            name = f"whole forward {f['batch']}x{f['tokens']} compiled strict / compiled default (time)"
            lines.append((name, None, t, 1.05, t <= 1.05))
    if args.vllm and args.vllm.is_file():
        res = json.loads(args.vllm.read_text())["results"]
        base = res.get("default", {}).get("output_tokens_per_s")
        bi = res.get("batch-invariant", {}).get("output_tokens_per_s")
        for config in ("strict", "strict-native-exp"):
            strict = res.get(config, {}).get("output_tokens_per_s")
            if base and strict:
                r = strict / base
                lines.append((f"vLLM generation {config} / default (tokens/s)", None, r, 0.85, r >= 0.85))
            if bi and strict:
                lines.append(
                    (f"vLLM generation {config} / VLLM_BATCH_INVARIANT=1", None, strict / bi, 1.0, strict / bi > 1)
                )
    print(f"{'target':66s} {'eager':>6s} {'ratio':>6s} {'need':>5s}  verdict")
    for name, eager, ratio, need, met in lines:
        eager = "" if eager is None else f"{eager:6.2f}"
        ratio = "" if ratio is None else f"{ratio:6.2f}"
        print(f"{name:66s} {eager:>6s} {ratio:>6s} {need:5.2f}  {'met' if met else 'missed'}")


if __name__ == "__main__":
    main()
