"""Does top-p's softmax and cumulative sum give a row the same bits at any row count? A probe, not a benchmark.

    python3 bench/top_p_probe.py [--device cuda] [--vocab 151936] [--json out.json]

alignaudit.engines.sampling.truncate runs top-p one [1, V] row per call, because the boundary depends on how the
softmax and the cumulative sum round and that could depend on how many rows a call holds. On a GPU that costs about
ten torch launches a row a decode step. This checks whether batching would keep the bits: each row of a batch of
fp32 logits (sorted ascending, as truncate sorts them), softmax(dim=-1).cumsum(dim=-1) computed alone as [1, V]
and inside batches of 2, 7, 32 and 64 rows at every place, and the top-p mask at p = 0.9 derived from each. Prints,
per batch size, how many rows differ from the row alone (values, and masks), and the host time of the per-row loop
against one batched call for 32 rows (the same ops as truncate's top-p). If every row matches on a GPU, truncate
could run top-p on the whole batch there; if not, the per-row loop (or a row-per-program kernel) stays.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BATCHES = (2, 7, 32, 64)


def cumulative(rows: torch.Tensor) -> torch.Tensor:
    """[n, V] fp32 sorted ascending -> the cumulative probability truncate compares with 1 - p."""
    return rows.softmax(dim=-1).cumsum(dim=-1)


def probe(device: str, vocab: int, p: float = 0.9) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(max(BATCHES), vocab, generator=g) * 3).to(device)
    ordered = logits.sort(dim=-1, stable=True).values
    alone = torch.cat([cumulative(ordered[i:i + 1]) for i in range(ordered.shape[0])])
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "vocab": vocab, "batches": {}}
    for n in BATCHES:
        values = masks = 0
        for start in range(0, ordered.shape[0] - n + 1, max(1, n // 2)):  # the rows at every place in some batch
            batched = cumulative(ordered[start:start + n])
            ref = alone[start:start + n]
            values += int((batched.view(torch.int32) != ref.view(torch.int32)).any(dim=-1).sum())
            masks += int(((batched <= 1 - p) != (ref <= 1 - p)).any(dim=-1).sum())
        result["batches"][n] = {"rows_with_other_values": values, "rows_with_another_mask": masks}
    result["host_us_32_rows"] = {"per_row": host_us(lambda: [cumulative(ordered[i:i + 1]) for i in range(32)], device),
                                 "batched": host_us(lambda: cumulative(ordered[:32]), device)}
    return result


def host_us(fn, device: str, calls: int = 20) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - start) / calls * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = probe(args.device, args.vocab)
    for n, r in result["batches"].items():
        print(f"batch {n:3d}: rows whose cumulative probabilities differ from the row alone "
              f"{r['rows_with_other_values']}, whose top-p mask differs {r['rows_with_another_mask']}")
    t = result["host_us_32_rows"]
    print(f"32 rows: per-row loop {t['per_row']} us, one batched call {t['batched']} us ({result['device']}, "
          f"torch {result['torch']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
