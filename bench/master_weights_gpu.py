"""fp32 master weights with a bf16 forward (alignaudit.engines.hf.strict.compute_in, what StrictGRPOTrainer runs) on
the GPU: the strict model kept in fp32 and computing in bf16 gives the logits of the strict model stored in bf16 bit
for bit, and its backward reaches every fp32 parameter.

    python bench/master_weights_gpu.py [--models qwen3-tiny,Qwen3-0.6B] [--device cuda]

Prints one line per model (differing logits, parameters without gradient) and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import sys

import torch


def check(model: str, device: str) -> bool:
    from alignaudit import api

    random = model not in ("qwen3-tiny", "qwen3-tiny-trained", "qwen2-tiny", "llama-tiny")
    master = api.strict_hf_model(model, dtype="fp32", device=device, random_weights=random, compute_dtype="bf16")
    stored = api.strict_hf_model(model, dtype="bf16", device=device, random_weights=random)
    ids = torch.randint(0, master.config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        a, b = master(input_ids=ids).logits, stored(input_ids=ids).logits
    differ = int((a.view(torch.int16) != b.view(torch.int16)).sum())
    master(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    no_grad = [n for n, p in master.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    print(
        f"{model} on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}: {differ} of {a.numel()} "
        f"logits differ (fp32 master + bf16 forward vs bf16 model), {len(no_grad)} of "
        f"{sum(1 for _ in master.parameters())} parameters without gradient {no_grad[:3]}",
        flush=True,
    )
    return differ == 0 and not no_grad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3-tiny,Qwen3-0.6B")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    ok = [check(m, args.device) for m in args.models.split(",")]
    sys.exit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
