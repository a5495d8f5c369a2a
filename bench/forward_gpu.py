"""A whole Qwen3-shape forward pass, default vs every op strict, measured side by side on one GPU.

    python3 bench/forward_gpu.py [--preset Qwen3-8B] [--batch 4] [--tokens 1024]

Builds the preset's exact shape with random weights directly on the GPU (transformers Qwen3ForCausalLM,
bf16), times the default forward (SDPA attention, cuBLAS) over batch x tokens, then swaps every strict op
in (alignaudit.strict.hf.make_strict) and times the same forward again, logits and logprobs included.
Prints both times and their ratio (median of several timed runs after warm-up, CUDA events).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alignaudit_kernels as K  # noqa: E402
from alignaudit.arch import PRESETS  # noqa: E402
from alignaudit.strict import STRICT_OPS  # noqa: E402
from alignaudit.strict.hf import make_strict  # noqa: E402


def median_ms(fn, warmup=2, reps=5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen3-8B")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**{k: v for k, v in PRESETS[args.preset].config.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.tokens), device="cuda")

    @torch.no_grad()
    def stock():
        logits = model(ids).logits
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])

    @torch.no_grad()
    def strict():
        logits = model(ids).logits
        return K.token_logprobs(logits[:, :-1], ids[:, 1:])

    default_ms = median_ms(stock)
    make_strict(model, frozenset(STRICT_OPS))
    strict_ms = median_ms(strict)
    print(f"{args.preset} forward, {args.batch} x {args.tokens} tokens, bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    print(f"default (sdpa, cuBLAS): {default_ms:.1f} ms   strict (every op): {strict_ms:.1f} ms   "
          f"strict/default time: {strict_ms / default_ms:.2f}x")


if __name__ == "__main__":
    main()
