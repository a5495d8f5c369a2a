"""compare --repeat N, inside the capture worker: the same engine, in one process, on the same token ids again,
N - 1 more times.

Repeat 1 runs the identical batch again (run-to-run determinism). Repeats 2 .. N - 1 place the audited
sequences among as many random filler sequences, at positions shuffled per repeat: the batch around a
sequence changes, its token ids do not (batch invariance, as vLLM's own determinism tests check it by
placing one audited prompt at different positions in batches of random prompts,
tests/v1/generation/test_batch_invariance.py). Each repeat's logprobs of the audited sequences are
compared bit for bit with the first run's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from alignaudit import numerics
from alignaudit.inputs.prompts import TokenBatch


@dataclass(frozen=True)
class RepeatBatch:
    """One repeat's batch; ``rows[i]`` is where audited sequence i sits in it."""

    kind: str  # "same batch" or "among fillers"
    batch: TokenBatch
    rows: tuple[int, ...]


def repeat_batches(batch: TokenBatch, repeats: int, vocab_size: int, seed: int) -> list[RepeatBatch]:
    """The batches of repeats 1 .. ``repeats`` - 1 (module docstring). Fillers: uniform random token ids in
    [0, vocab_size), lengths drawn from the audited sequences', seeded by ``seed`` and the repeat."""
    out = []
    for r in range(1, repeats):
        if r == 1:
            out.append(RepeatBatch("same batch", batch, tuple(range(len(batch.sequences)))))
            continue
        rng = random.Random(seed * 1_000_003 + r)
        lengths = [len(s) for s in batch.sequences]
        fillers = [tuple(rng.randrange(vocab_size) for _ in range(rng.choice(lengths))) for _ in batch.sequences]
        order = list(range(2 * len(batch.sequences)))  # < n: audited sequence i; >= n: filler i - n
        rng.shuffle(order)
        n = len(batch.sequences)
        sequences = tuple(batch.sequences[k] if k < n else fillers[k - n] for k in order)
        rows = tuple(order.index(i) for i in range(n))
        out.append(RepeatBatch("among fillers", TokenBatch(sequences, (None,) * len(sequences), "repeat"), rows))
    return out


def compare_repeat(first: list[torch.Tensor], again: list[torch.Tensor]) -> dict:
    """Audited logprobs of the first run vs a repeat (fp32 per sequence, same order): tokens, mismatches
    (not bitwise equal, NaN against NaN of the same bits equal), max ULP over finite pairs."""
    a, b = torch.cat(first), torch.cat(again)
    equal = numerics.bitwise_equal(a, b)
    finite = torch.isfinite(a) & torch.isfinite(b)
    ulp = numerics.ulp_distance(a[finite], b[finite])
    return {"tokens": a.numel(), "mismatches": int((~equal).sum()), "ulp_max": int(ulp.max()) if ulp.numel() else 0}


def run_repeats(engine, batch: TokenBatch, first: list[torch.Tensor], repeats: int, seed: int) -> list[dict]:
    """Run ``engine`` (already used for ``first`` = its logprobs on ``batch``) on every repeat batch; one
    record per repeat: repeat, kind, batch_size, rows (where the audited sequences sat), and compare_repeat's
    fields."""
    records = []
    for r, rb in enumerate(repeat_batches(batch, repeats, engine.spec.vocab_size, seed), start=1):
        logprobs = engine.prompt_logprobs(rb.batch)
        again = [logprobs[row] for row in rb.rows]
        records.append(
            {
                "repeat": r,
                "kind": rb.kind,
                "batch_size": len(rb.batch.sequences),
                "rows": list(rb.rows),
                **compare_repeat(first, again),
            }
        )
    return records
