"""Capture overhead: forward time with every canonical op captured, as a ratio to the bare forward pass.

    .venv/bin/python bench/capture_overhead.py [--model DIR] [--prompts 8] [--prompt-len 256] [--dtype bf16]

Runs each engine in its own worker, once without op capture and once with all ops, on the same random
prompts, and reads the forward time each worker measured around the engine's logprob call (model load
excluded). vLLM's op capture runs in eager mode, so its bare run is eager too (the compiled run is
listed for reference). Prints one row per engine; writes bench-capture-overhead.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alignaudit.capture.ops import Selection  # noqa: E402
from alignaudit.inputs.checkpoint import load_spec  # noqa: E402
from alignaudit.inputs.prompts import load_prompts  # noqa: E402
from alignaudit.inputs.request import EngineSettings  # noqa: E402
from alignaudit.pipelines.runs import EngineRun, capture  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def forward_seconds(spec, batch, engine, dtype, out, ops, **options) -> float:
    run = EngineRun(engine, EngineSettings(dtype=dtype, device="cpu", options=options))
    return capture(spec, batch, run, out, ops=Selection() if ops else None).manifest["timing_s"]["forward"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "fixtures" / "qwen3-tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    spec = load_spec(args.model)
    batch = load_prompts(spec, random_prompts=args.prompts, prompt_len=args.prompt_len)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for engine, options in (("hf", {}), ("megatron", {}), ("vllm", {"enforce_eager": True})):
            bare = forward_seconds(spec, batch, engine, args.dtype, tmp / f"{engine}-bare", False, **options)
            ops = forward_seconds(spec, batch, engine, args.dtype, tmp / f"{engine}-ops", True)
            rows.append({"engine": engine, "bare_s": bare, "capture_s": ops, "ratio": ops / bare})
        compiled = forward_seconds(spec, batch, "vllm", args.dtype, tmp / "vllm-compiled", False)
    print(f"capture overhead, {spec.name}, {args.prompts} x {args.prompt_len} tokens, {args.dtype}")
    print(f"{'engine':10s} {'bare forward s':>15s} {'with ops s':>11s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['engine']:10s} {r['bare_s']:15.3f} {r['capture_s']:11.3f} {r['ratio']:7.2f}")
    print(f"(vllm compiled bare forward: {compiled:.3f} s)")
    Path("bench-capture-overhead.json").write_text(json.dumps({"rows": rows, "vllm_compiled_s": compiled}, indent=2))


if __name__ == "__main__":
    main()
