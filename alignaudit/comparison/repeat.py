"""compare --repeat N: the records of the repeats each worker ran (alignaudit.workers.repeats) summed up per side."""

from __future__ import annotations


def summarize_repeats(records: list[dict]) -> dict:
    """One side's repeats in one record: runs (the first included), tokens per run, repeats whose
    logprobs differ from the first run's, mismatching tokens over all repeats, max ULP."""
    return {
        "runs": len(records) + 1,
        "tokens": records[0]["tokens"] if records else 0,
        "repeats_differing": sum(1 for r in records if r["mismatches"]),
        "mismatches": sum(r["mismatches"] for r in records),
        "ulp_max": max((r["ulp_max"] for r in records), default=0),
        "per_repeat": records,
    }
