"""Does top-p's softmax and cumulative sum give a row the same bits at any row count? A probe, not a benchmark.

    python3 bench/top_p_probe.py [--device cuda] [--vocab 151936] [--json out.json]

alignaudit.engines.sampling.truncate runs top-p one [1, V] row per call, because the boundary depends on how the
softmax and the cumulative sum round and that could depend on how many rows a call holds. On a GPU that costs about
ten torch launches a row a decode step. This checks whether batching would keep the bits: 64 rows of fp32 logits
(sorted ascending, as truncate sorts them), softmax(dim=-1).cumsum(dim=-1) of each computed alone as [1, V], then
inside batches of 2, 7, 32 and 64 consecutive rows starting at every row (so each row at every place a batch of
that size can hold it), and the top-p mask at p = 0.9 (cumulative <= 1 - p in fp32, as truncate compares) derived
from each. Prints, per batch size, how many of the (batch, row) pairs tested differ from the row alone (values, and
masks) and from the same row in one batch of all 64 (are batches of two or more alike, where a [1, V] call takes
another path?), and the wall time (synchronized) of softmax + cumsum a row a call against one call for 32 rows: the part
of truncate's top-p whose bits could depend on the batch, not its sort, mask and scatter. If every row matches on a
GPU, truncate could run top-p on the whole batch there; if not, the per-row loop (or a row-per-program kernel)
stays.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.launch_overhead import host_us  # noqa: E402  (calls back to back, synchronized at the end)

BATCHES = (2, 7, 32, 64)


def cumulative(rows: torch.Tensor) -> torch.Tensor:
    """[n, V] fp32 sorted ascending -> the cumulative probability truncate compares with 1 - p."""
    return rows.softmax(dim=-1).cumsum(dim=-1)


def probe(device: str, vocab: int, p: float = 0.9) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(max(BATCHES), vocab, generator=g) * 3).to(device)
    ordered = logits.sort(dim=-1, stable=True).values
    alone = torch.cat([cumulative(ordered[i : i + 1]) for i in range(ordered.shape[0])])
    whole = cumulative(ordered)  # every row in the one batch of 64
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "vocab": vocab,
        "batches": {},
    }
    limit = 1 - torch.tensor(p, dtype=torch.float32, device=device)  # truncate's fp32 1 - p
    for n in BATCHES:
        values = masks = other_batch = tested = 0
        for start in range(ordered.shape[0] - n + 1):
            batched = cumulative(ordered[start : start + n])
            ref = alone[start : start + n]
            values += int((batched.view(torch.int32) != ref.view(torch.int32)).any(dim=-1).sum())
            masks += int(((batched <= limit) != (ref <= limit)).any(dim=-1).sum())
            other_batch += int((batched.view(torch.int32) != whole[start : start + n].view(torch.int32)).any(-1).sum())
            tested += n
        result["batches"][n] = {
            "pairs_tested": tested,
            "pairs_with_other_values": values,
            "pairs_with_another_mask": masks,
            "pairs_unlike_the_batch_of_64": other_batch,
        }
    per_row = host_us(lambda: [cumulative(ordered[i : i + 1]) for i in range(32)], 20, device)
    result["wall_us_32_rows"] = {
        "per_row": round(per_row, 1),
        "batched": round(host_us(lambda: cumulative(ordered[:32]), 20, device), 1),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = probe(args.device, args.vocab)
    for n, r in result["batches"].items():
        print(
            f"batch {n:3d}: of {r['pairs_tested']} (batch, row) pairs, cumulative probabilities differ from the row "
            f"alone in {r['pairs_with_other_values']}, the top-p mask in {r['pairs_with_another_mask']}; from the "
            f"same row in the batch of 64 in {r['pairs_unlike_the_batch_of_64']}"
        )
    t = result["wall_us_32_rows"]
    print(
        f"32 rows, softmax + cumsum: a row a call {t['per_row']} us, one call {t['batched']} us (wall, "
        f"{result['device']}, torch {result['torch']})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
