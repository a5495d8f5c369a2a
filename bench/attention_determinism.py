"""Is an attention backward deterministic on this GPU? Runs it N times on the same inputs and counts the distinct
bit patterns of dq, dk and dv: torch's SDPA backward as a trainer runs it (its default backend: cuDNN's on an H200),
SDPA with forward and backward under torch's deterministic mode (which excludes cuDNN's SDPA: FlashAttention-2's
deterministic backward there), and alignaudit's fused varlen backward (ALIGNAUDIT_BACKWARD=fused,
kernels/alignaudit_kernels/attention/flash_gradients.py). One distinct pattern: the same bits every run.

    python3 bench/attention_determinism.py [--runs 8] [--lengths 4096,1500,700] [--json OUT.json]

GQA 32/8, d 128, bf16, random inputs (seeded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alignaudit_kernels as K  # noqa: E402
from alignaudit_kernels.attention.flash_gradients import deterministic_algorithms  # noqa: E402


def distinct_patterns(backward, runs: int) -> dict[str, int]:
    """Distinct bit patterns of each gradient of ``backward()`` (a tuple dq, dk, dv) over ``runs`` calls."""
    seen: list[set[bytes]] = [set(), set(), set()]
    for _ in range(runs):
        for found, grad in zip(seen, backward(), strict=True):
            found.add(grad.contiguous().view(torch.int16).cpu().numpy().tobytes())
    return {name: len(found) for name, found in zip(("dq", "dk", "dv"), seen, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--lengths", default="4096,1500,700")
    parser.add_argument("--json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    h, kvh, d, t = 32, 8, 128, sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, go = (torch.randn(t, n, d, generator=g, device="cuda", dtype=torch.bfloat16) for n in (h, kvh, kvh, h))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def sdpa():  # one sequence at a time, as a padded-free trainer would: [1, H, T, D]
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            ins = [x[a:b].transpose(0, 1)[None].detach().requires_grad_() for x in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*ins, is_causal=True, enable_gqa=True)
            for grad, part in zip(grads, torch.autograd.grad(out, ins, go[a:b].transpose(0, 1)[None]), strict=True):
                grad[a:b] = part[0].transpose(0, 1)
        return grads

    def fused():
        os.environ["ALIGNAUDIT_BACKWARD"] = "fused"
        try:
            ins = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(K.varlen_attention(*ins, cu, d**-0.5), ins, go)
        finally:
            os.environ.pop("ALIGNAUDIT_BACKWARD")

    def sdpa_deterministic():
        with deterministic_algorithms():
            return sdpa()

    result = {"lengths": lengths, "runs": args.runs, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, backward in (
        ("sdpa, default backend", sdpa),
        ("sdpa, deterministic mode", sdpa_deterministic),
        ("alignaudit fused varlen", fused),
    ):
        result[name] = distinct_patterns(backward, args.runs)
        print(f"{name:32s} distinct bit patterns over {args.runs} runs: {result[name]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
