"""What a report shows of a comparison, as plain records both renderers read (reports/terminal.py, reports/html/).

- ``summary_sections``: summary.json (alignaudit.comparison.token_diff.summarize) grouped into sections, each
  row a (label, text, field): Alignment, RL impact, Importance weights, Distribution (full vocabulary), Routing
  (MoE), Repeats, Generated tokens. A section whose data the summary lacks is left out, never shown as zeros;
  sub-dicts this module does not know (``importance``, ``vocab``, new keys of ``rl``) are rendered generically,
  key -> readable label (``readable``).
- ``ulp_buckets``: the fp32 ULP distances of a tokens table in log2 buckets (0, 1, 2-3, 4-7, ... up to the
  bucket of the largest distance measured), NaN and Inf mismatches counted apart, never in a finite bucket.
- ``prompt_ends``: per sequence, the first generated position (rollout mode): where the prompt ends.

Pure: dicts and DataFrames in, records out; no plotting, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

# pair_class values of tokens.parquet (alignaudit.numerics.PairClass; docs/output.md)
FINITE_DIFF, NAN_MISMATCH, INF_MISMATCH = 1, 2, 3

WORDS = {
    "kl": "KL",
    "tv": "TV",
    "ulp": "ULP",
    "nan": "NaN",
    "inf": "Inf",
    "ess": "ESS",
    "eps": "eps",
    "is": "IS",
    "p99": "p99",
    "p50": "p50",
    "max": "max",
    "min": "min",
    "std": "std",
    "mc": "MC",
    "js": "JS",
    "topk": "top-k",
    "k1": "k1",
    "k2": "k2",
    "k3": "k3",
    "lp": "logprob",
    "ppo": "PPO",
    "tis": "TIS",
    "mis": "MIS",
    "seq": "sequence",
    "frac": "fraction",
}


def readable(key: str) -> str:
    """A summary key as a label: ``kl_k3_mean`` -> ``KL k3 mean``, ``top_5_agreement`` -> ``top 5 agreement``,
    ``kl_train_infer`` -> ``KL train infer``."""
    words = [WORDS.get(w.lower(), w) for w in str(key).replace("-", "_").split("_") if w]
    text = " ".join(words)
    return text[:1].upper() + text[1:] if text[:1].islower() else text


def number(value, spec: str = "") -> str:
    """A value as text: '-' for None/NaN, ints as they are, floats in ``spec`` (default: 4 significant digits,
    scientific below 1e-3 or from 1e6)."""
    if value is None or isinstance(value, float) and math.isnan(value):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if spec:
            return "0" if value == 0 and "e" in spec else format(value, spec)
        v = float(value)
        if v.is_integer() and abs(v) < 1e15 and not spec:
            return str(int(v))  # a median or percentile of integer distances
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.6g}" if abs(v) >= 1 else f"{v:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(number(v) for v in value) if value else "-"
    return str(value)


@dataclass
class Section:
    """One group of a report's summary: a title, an anchor, rows of (label, text, field); ``field`` is the
    summary key (dotted) the row shows, '' for a row made of several."""

    title: str
    anchor: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    note: str = ""

    def add(self, label: str, text: str, key: str = "") -> None:
        self.rows.append((label, text, key))


def generic_rows(section: Section, record: dict, prefix: str, skip: tuple[str, ...] = ()) -> None:
    """Every key of ``record`` not in ``skip`` as a row, nested dicts flattened ("a: b"), labels ``readable``."""
    for key, value in record.items():
        if key in skip:
            continue
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    section.add(
                        f"{readable(key)}: {readable(sub)}",
                        ", ".join(f"{readable(k)} {number(x)}" for k, x in v.items()),
                        f"{name}.{sub}",
                    )
                else:
                    section.add(f"{readable(key)}: {readable(sub)}", number(v), f"{name}.{sub}")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            section.add(
                readable(key),
                "; ".join(", ".join(f"{readable(k)} {number(x)}" for k, x in v.items()) for v in value),
                name,
            )
        else:
            section.add(readable(key), number(value), name)


def _ratio_range(rl: dict) -> str:
    return f"{number(rl.get('ratio_min'), '.6f')} .. {number(rl.get('ratio_max'), '.6f')}"


def brief_importance(imp: dict) -> Section:
    """The importance diagnostics a terminal shows (alignaudit.comparison.importance; the rest stays in
    summary.json): the fractions of tokens and sequences each correction would truncate or mask at the run's
    thresholds, the effective sample size and the k1/k3 KL."""
    s = Section(
        "Importance weights", "importance", note="every diagnostic: summary.json's importance (docs/rl-metrics.md)"
    )
    scope = f" ({imp['scope']})" if imp.get("scope") else ""
    rows = (
        ("token_tis_fraction", f"tokens truncated, ratio > {imp.get('tis_threshold', '?'):g}{scope}"),
        (
            "token_mask_fraction",
            f"tokens masked, ratio outside [{imp.get('mask_low', '?'):g}, {imp.get('mask_high', '?'):g}]",
        ),
        (
            "seq_mask_fraction",
            f"sequences masked, sequence ratio outside [{imp.get('mask_low', '?'):g}, {imp.get('mask_high', '?'):g}]",
        ),
        (
            "geo_mask_fraction",
            f"sequences masked, geometric mean outside [{imp.get('geo_mask_low', '?'):g}, "
            f"{imp.get('geo_mask_high', '?'):g}]",
        ),
    )
    for key, label in rows:
        if key in imp:
            s.add(label, number(imp[key], ".2%") if imp[key] is not None else "-", f"importance.{key}")
    if "token_ess" in imp:
        s.add(
            "effective sample size, tokens / sequences",
            f"{number(imp['token_ess'])} / {number(imp.get('seq_ess'))}",
            "importance.token_ess",
        )
    if "kl_k1" in imp:
        s.add("KL k1 / k3", f"{number(imp['kl_k1'])} / {number(imp.get('kl_k3'))}", "importance.kl_k3")
    return s


def summary_sections(
    summary: Mapping[str, Any], buckets: list[dict] | None = None, histogram: bool = True, brief: bool = False
) -> list[Section]:
    """summary.json as the sections a report shows (module docstring). ``buckets``: ``ulp_buckets`` of the
    tokens table (shown in Alignment as the non-empty log2 buckets); without them the summary's fixed buckets;
    ``histogram=False``: neither (a page that draws the histogram). ``brief`` (the terminal): of the importance
    diagnostics only what each correction would discard, the ESS and the KL (``brief_importance``).

    Raises:
        KeyError: the summary lacks tokens_compared or mismatches (callers check SUMMARY_FIELDS first).
    """
    sections = (
        _alignment_section(summary, buckets, histogram),
        _rl_section(summary.get("rl")),
        _importance_section(summary, brief),
        _vocab_section(summary),
        _routing_section(summary),
        _repeats_section(summary),
        _generated_section(summary),
    )
    return [s for s in sections if s is not None]


def _alignment_section(summary: Mapping[str, Any], buckets: list[dict] | None, histogram: bool) -> Section:
    n, bad = summary["tokens_compared"], summary["mismatches"]
    a = Section("Alignment", "alignment")
    sequences = summary.get("sequences")
    a.add("tokens compared", f"{n}", "tokens_compared")
    if sequences is not None:
        a.add("sequences", f"{sequences}", "sequences")
    a.add("mismatches (bitwise)", f"{bad}", "mismatches")
    if summary.get("mismatch_fraction") is not None:
        a.add("mismatch fraction", f"{summary['mismatch_fraction']:.2%}", "mismatch_fraction")
    if "ulp_max" in summary:
        a.add(
            "ULP (fp32) max / median / p99",
            f"{number(summary['ulp_max'])} / {number(summary.get('ulp_median'))} / {number(summary.get('ulp_p99'))}",
            "ulp_max",
        )
    if "max_abs_diff" in summary:
        a.add(
            "max |d logprob|",
            number(summary["max_abs_diff"], ".3e") if summary["max_abs_diff"] is not None else "-",
            "max_abs_diff",
        )
    if "mean_abs_diff" in summary:
        a.add(
            "mean |d| / mean d (signed)",
            f"{number(summary['mean_abs_diff'])} / "
            f"{number(summary.get('mean_diff'), '+.3e') if summary.get('mean_diff') is not None else '-'}",
            "mean_abs_diff",
        )
    if not histogram:
        pass
    elif buckets is not None:
        shown = [f"{k if k < 2 else f'2^{k - 1}'}: {b['count']}" for k, b in enumerate(buckets) if b["count"]]
        a.add("ULP histogram (2^k: 2^k to 2^(k+1)-1)", "  ".join(shown) or "-", "")
    elif summary.get("ulp_histogram"):
        a.add("ULP histogram", "  ".join(f"{k}: {v}" for k, v in summary["ulp_histogram"].items()), "ulp_histogram")
    nan, inf = summary.get("nan_tokens"), summary.get("inf_tokens")
    if nan is not None or inf is not None:
        specials = [
            (kind, counts)
            for kind, counts in (("NaN", nan), ("Inf", inf))
            if counts and (counts.get("train") or counts.get("infer"))
        ]
        if specials:
            for kind, c in specials:
                a.add(
                    f"{kind} logprobs train / infer / both",
                    f"{c.get('train')} / {c.get('infer')} / {c.get('both')}",
                    f"{kind.lower()}_tokens",
                )
        else:
            a.add("NaN / Inf logprobs", "none", "")
    if summary.get("nan_mismatches") or summary.get("inf_mismatches"):
        a.add("NaN / Inf mismatches", f"{summary.get('nan_mismatches')} / {summary.get('inf_mismatches')}", "")
    a.note = summary.get("attention_note", "")
    return a


def _rl_section(rl: dict | None) -> Section | None:
    if rl:
        s = Section("RL impact", "rl-impact")
        known = (
            "clip_eps",
            "ratio_min",
            "ratio_max",
            "clip_fraction",
            "token_mult_prob_error",
            "prob_diff_max",
            "prob_diff_mean",
            "kl_k3_mean",
            "importance",
        )
        if "ratio_min" in rl or "ratio_max" in rl:
            s.add("importance ratio exp(d) min .. max", _ratio_range(rl), "rl.ratio_max")
        if "clip_fraction" in rl:
            eps = rl.get("clip_eps")
            where = f" outside [{1 - eps:g}, {1 + eps:g}]" if eps is not None else ""
            s.add(
                f"clip fraction{where}",
                number(rl["clip_fraction"], ".2%") if rl["clip_fraction"] is not None else "-",
                "rl.clip_fraction",
            )
        if "kl_k3_mean" in rl:
            s.add("KL k3 (infer || train), mean", number(rl["kl_k3_mean"]), "rl.kl_k3_mean")
        if "token_mult_prob_error" in rl:
            s.add(
                "token_mult_prob_error",
                number(rl["token_mult_prob_error"], ".9f") if rl["token_mult_prob_error"] is not None else "-",
                "rl.token_mult_prob_error",
            )
        if "prob_diff_max" in rl:
            s.add(
                "|p_train - p_infer| max / mean",
                f"{number(rl['prob_diff_max'])} / {number(rl.get('prob_diff_mean'))}",
                "rl.prob_diff_max",
            )
        generic_rows(s, rl, "rl", known)
        return s
    return None


def _importance_section(summary: Mapping[str, Any], brief: bool) -> Section | None:
    importance = summary.get("importance") or (summary.get("rl") or {}).get("importance")
    if isinstance(importance, dict) and importance:
        if brief:
            return brief_importance(importance)
        s = Section("Importance weights", "importance")
        generic_rows(s, importance, "importance")
        return s
    return None


def _vocab_section(summary: Mapping[str, Any]) -> Section | None:
    vocab = summary.get("vocab")
    if isinstance(vocab, dict) and vocab:
        s = Section("Distribution (full vocabulary)", "distribution")
        generic_rows(s, vocab, "vocab")
        return s
    if summary.get("vocab_note"):  # one capture holds rows, the other not: say why nothing is compared
        return Section("Distribution (full vocabulary)", "distribution", note=f"not compared: {summary['vocab_note']}")
    return None


def _routing_section(summary: Mapping[str, Any]) -> Section | None:
    replay = summary.get("routing_replay")
    if summary.get("routing") or replay:
        s = Section("Routing (MoE)", "routing")
        for r in summary.get("routing") or ():
            agree = f" ({r['agreement']:.1%} agree)" if r.get("agreement") is not None else ""
            s.add(
                f"layer {r.get('layer')}",
                f"{r.get('rerouted')} of {r.get('tokens')} positions rerouted{agree}",
                f"routing.{r.get('layer')}",
            )
        if replay:  # compare --replay-routing: the trainer's own routing -> the rollout engine's, replayed
            s.add(
                "rerouted tokens, own -> replayed routing",
                f"{replay['rerouted_before']} -> {replay['rerouted_after']}",
                "routing_replay.rerouted_after",
            )
            s.add(
                "mismatching tokens, own -> replayed routing",
                f"{replay['mismatches_before']} -> {replay['mismatches_after']} of {replay['tokens_compared']}",
                "routing_replay.mismatches_after",
            )
            s.add(
                "max ULP / max |d|, own -> replayed routing",
                f"{number(replay['ulp_max_before'])} -> {number(replay['ulp_max_after'])} / "
                f"{number(replay['max_abs_diff_before'])} -> {number(replay['max_abs_diff_after'])}",
                "routing_replay.ulp_max_after",
            )
            s.add(
                "train logprobs the replay changed",
                str(replay["tokens_changed_by_replay"]),
                "routing_replay.tokens_changed_by_replay",
            )
        return s
    if summary.get("routing_note"):
        return Section("Routing (MoE)", "routing", note=f"not read: {summary['routing_note']}")
    return None


def _repeats_section(summary: Mapping[str, Any]) -> Section | None:
    if summary.get("repeats"):
        s = Section("Repeats (each engine against its first run)", "repeats")
        for role, r in summary["repeats"].items():
            s.add(
                f"{role} engine, {r.get('runs')} runs",
                f"{r.get('repeats_differing')} of {(r.get('runs') or 1) - 1} repeats differ; max ULP "
                f"{number(r.get('ulp_max'))}",
                f"repeats.{role}",
            )
            for p in r.get("per_repeat") or ():
                s.add(
                    f"{role} repeat {p.get('repeat')} ({p.get('kind')}, batch of {p.get('batch_size')})",
                    f"{p.get('mismatches')} of {p.get('tokens')} tokens differ, max ULP {number(p.get('ulp_max'))}",
                    "",
                )
        return s
    return None


def _generated_section(summary: Mapping[str, Any]) -> Section | None:
    g = summary.get("generated")
    if g:
        s = Section("Generated tokens only (rollout)", "generated")
        s.add(
            "mismatches (bitwise)",
            f"{g['mismatches']} of {g['tokens_compared']}"
            + (f" ({g['mismatch_fraction']:.2%})" if g.get("mismatch_fraction") is not None else ""),
            "generated.mismatches",
        )
        s.add("ULP max / median", f"{number(g.get('ulp_max'))} / {number(g.get('ulp_median'))}", "generated.ulp_max")
        s.add("max |d logprob|", number(g.get("max_abs_diff")), "generated.max_abs_diff")
        grl = g.get("rl") or {}
        if grl:
            s.add("importance ratio min .. max", _ratio_range(grl), "generated.rl.ratio_max")
            s.add("KL k3 (infer || train), mean", number(grl.get("kl_k3_mean")), "generated.rl.kl_k3_mean")
        return s
    return None


def side_label(side: dict) -> str:
    """``engine (dtype, device, strict ..., TP=n, options)`` of one side of a comparison (its run.json record), plain
    text; what a side's record lacks (a rollout file's dtype and device) is left out, and a long option is shortened
    (option_text)."""
    parts = [
        side.get("dtype"),
        side.get("device"),
        f"strict {side['strict']}" if side.get("strict") else None,
        f"{side['strict_exp']} exp" if side.get("strict_exp") not in (None, "portable") else None,
        "flash attention" if side.get("strict_attention") == "flash" else None,
        "fp32 lm_head" if side.get("lm_head_dtype") == "fp32" else None,
        f"TP={side['tensor_parallel_size']}" if side.get("tensor_parallel_size", 1) != 1 else None,
        *(option_text(k, v) for k, v in (side.get("options") or {}).items()),
    ]
    shown = ", ".join(str(part) for part in parts if part)
    engine = side.get("engine", "?")
    return f"{engine} ({shown})" if shown else engine


def option_text(key: str, value, limit: int = 60) -> str:
    """``key=value``; a list longer than ``limit`` characters as its ends and length (``stop_token_ids=[1000, ...,
    2999] (2000 items)``), any other long value cut at ``limit`` with an ellipsis. The whole value stays in run.json."""
    text = f"{key}={value}"
    if len(text) <= limit:
        return text
    if isinstance(value, (list, tuple)) and value:
        return f"{key}=[{value[0]}, ..., {value[-1]}] ({len(value)} items)"
    return text[: limit - 1] + "…"


def bucket_label(k: int) -> str:
    """The label of log2 bucket ``k`` (ULP distances 2^(k-1) to 2^k - 1): "0", "1", "2-3", ..., "4096-8191",
    then "[2^13, 2^14)" and so on."""
    if k <= 1:
        return str(k)
    lo, hi = 2 ** (k - 1), 2**k - 1
    return f"{lo}-{hi}" if k <= 13 else f"[2^{k - 1}, 2^{k})"


def bucket_of(ulp: np.ndarray) -> np.ndarray:
    """Log2 bucket index of each ULP distance (int64 >= 0): 0 for 0, k for 2^(k-1) <= ulp < 2^k (exact in
    integer arithmetic: the bit length of ulp)."""
    u = np.asarray(ulp, dtype=np.int64)
    out = np.zeros(u.shape, dtype=np.int64)
    rest = u.copy()
    while (rest > 0).any():  # bit length, without float log2 rounding
        out += rest > 0
        rest >>= 1
    return out


def ulp_buckets(tokens: pd.DataFrame) -> tuple[list[dict], dict[str, int]]:
    """The fp32 ULP distances of a tokens table (columns ``ulp``, ``pair_class``) in log2 buckets.

    Returns:
        (buckets, special): buckets, one per k from 0 to the bucket of the largest finite distance, as
        ``{"label", "lo", "hi", "count"}`` (lo and hi inclusive ULP distances; count of finite pairs, pair_class
        0 or 1, bitwise-equal pairs in bucket 0); special: ``{"NaN mismatch": n, "Inf mismatch": n}``, pairs
        whose distance is meaningless (pair_class 2 and 3, ulp -1), never in a finite bucket.
    """
    cls = tokens["pair_class"].to_numpy()
    finite = cls <= FINITE_DIFF
    idx = bucket_of(tokens["ulp"].to_numpy()[finite])
    counts = np.bincount(idx, minlength=int(idx.max()) + 1 if len(idx) else 1)
    buckets = [
        {
            "label": bucket_label(k),
            "lo": 0 if k == 0 else 2 ** (k - 1),
            "hi": 0 if k == 0 else 2**k - 1,
            "count": int(c),
        }
        for k, c in enumerate(counts)
    ]
    special = {"NaN mismatch": int((cls == NAN_MISMATCH).sum()), "Inf mismatch": int((cls == INF_MISMATCH).sum())}
    return buckets, special


def prompt_ends(tokens: pd.DataFrame) -> dict[int, int]:
    """Per sequence with generated tokens (rollout mode: the ``generated`` column), the position of its first
    generated token, which is the prompt's length: positions 0..P-1 are the prompt. {} in prompt mode."""
    if "generated" not in tokens or not tokens["generated"].any():
        return {}
    gen = tokens[tokens["generated"].to_numpy(dtype=bool)]
    return {int(s): int(p) for s, p in gen.groupby("seq")["pos"].min().items()}
