"""Full-vocabulary divergence per position (``compare --full-vocab``). Pure: rows and tables in, records out.

Each engine's row at a scored position is its own fp32 log-softmax over the whole vocabulary (alignaudit.capture.
vocab_rows; how each engine computes it: the manifest's ``vocab.rows``). Per position, in float64, from the train
row a and the infer row b:

    normalization   la = a - logsumexp(a), lb = b - logsumexp(b): each fp32 row renormalized in fp64, so the
                    measures below are those of two proper distributions p = exp(la), q = exp(lb) (an fp32 row's
                    own normalization error, |logsumexp(a)|, is ~1e-7 and would otherwise make a tiny KL negative)
    KL(train||infer) sum_v p_v (la_v - lb_v) over p_v > 0 (0 log 0 = 0); +inf where q_v = 0 < p_v
    KL(infer||train) the same with the roles swapped (Kullback and Leibler 1951; both directions exact, every
                    vocabulary entry summed, no sampling estimate)
    total variation 0.5 * sum_v |p_v - q_v|
    top-1 agreement the two rows' argmax is the same token
    top-k overlap   |top-k(a) & top-k(b)| / k with k = TOP_K = 5
Ties in top-1 / top-k go to the lower token id (a stable descending sort of the fp32 rows). Identical rows give
KL = 0 and TV = 0 exactly. A row holding NaN or +inf (the engine's values, kept as they came) makes its position
``nonfinite``: its measures are NaN, counted apart and never averaged in.

Two more columns check the rows against the capture's own logprobs: ``vocab_row_matches_train`` /
``_infer``, whether the row's entry at the sequence's next token is bit for bit the logprob the engine reported
(by construction wherever the engine's logprob is that row's gather; a mismatch says the rows are not what the
logprobs were computed from).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import torch

TOP_K = 5
COLUMNS = (
    "vocab_kl_train_infer",
    "vocab_kl_infer_train",
    "vocab_tv",
    "vocab_top1_agree",
    "vocab_topk_overlap",
    "vocab_nonfinite",
    "vocab_row_matches_train",
    "vocab_row_matches_infer",
)
MEASURES = {"kl_train_infer": "vocab_kl_train_infer", "kl_infer_train": "vocab_kl_infer_train", "tv": "vocab_tv"}
CHUNK_ELEMENTS = 1 << 24  # rows are compared this many float64 elements at a time


def position_divergence(train: torch.Tensor, infer: torch.Tensor, k: int = TOP_K) -> dict[str, np.ndarray]:
    """The measures of the module docstring for each row pair.

    Args:
        train, infer: float32 [n, V] log-softmax rows (the same positions).
        k: top-k size (at most V).
    Returns:
        ``kl_train_infer``, ``kl_infer_train``, ``tv`` (float64 [n], NaN where nonfinite), ``top1_agree`` (bool
        [n]), ``topk_overlap`` (float64 [n], in [0, 1]), ``nonfinite`` (bool [n]).
    Raises:
        ValueError: shapes differ, are not 2-D, or k is not in 1..V.
    """
    if train.shape != infer.shape or train.dim() != 2:
        raise ValueError(
            f"position_divergence: rows {tuple(train.shape)} vs {tuple(infer.shape)}, expected [n, V] each"
        )
    n, v = train.shape
    if not 1 <= k <= v:
        raise ValueError(f"position_divergence: k={k} outside 1..{v}")
    out = {
        name: np.empty(n, dtype=dtype)
        for name, dtype in (
            ("kl_train_infer", np.float64),
            ("kl_infer_train", np.float64),
            ("tv", np.float64),
            ("top1_agree", bool),
            ("topk_overlap", np.float64),
            ("nonfinite", bool),
        )
    }
    step = max(1, CHUNK_ELEMENTS // max(v, 1))
    for lo in range(0, n, step):
        part = _chunk(train[lo : lo + step], infer[lo : lo + step], k)
        for name, values in part.items():
            out[name][lo : lo + step] = values
    return out


def _chunk(a32: torch.Tensor, b32: torch.Tensor, k: int) -> dict[str, np.ndarray]:
    a, b = a32.double(), b32.double()
    nonfinite = (torch.isnan(a) | (a == float("inf"))).any(-1) | (torch.isnan(b) | (b == float("inf"))).any(-1)
    la = a - torch.logsumexp(a, -1, keepdim=True)
    lb = b - torch.logsumexp(b, -1, keepdim=True)
    p, q = la.exp(), lb.exp()
    kl_pq = torch.where(p > 0, p * (la - lb), 0.0).sum(-1)
    kl_qp = torch.where(q > 0, q * (lb - la), 0.0).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    top_a = torch.sort(a32, dim=-1, descending=True, stable=True).indices[:, :k]
    top_b = torch.sort(b32, dim=-1, descending=True, stable=True).indices[:, :k]
    overlap = (top_a[:, :, None] == top_b[:, None, :]).any(-1).sum(-1).double() / k
    bad = nonfinite.numpy()
    result = {"kl_train_infer": kl_pq.numpy(), "kl_infer_train": kl_qp.numpy(), "tv": tv.numpy()}
    result = {name: np.where(bad, np.nan, x) for name, x in result.items()}
    result.update(
        top1_agree=(top_a[:, 0] == top_b[:, 0]).numpy() & ~bad,
        topk_overlap=np.where(bad, np.nan, overlap.numpy()),
        nonfinite=bad,
    )
    return result


def vocab_columns(
    tokens: pd.DataFrame,
    train_rows: Callable[[int], torch.Tensor],
    infer_rows: Callable[[int], torch.Tensor],
    k: int = TOP_K,
) -> pd.DataFrame:
    """``tokens`` (token_diff.compare_tokens output: seq, pos, token_id, lp_train, lp_infer) with COLUMNS added.

    ``train_rows(seq)`` / ``infer_rows(seq)``: that sequence's rows, float32 [len - 1, V]; the token at position
    pos is scored by row pos - 1. Each sequence's rows are read once.
    """
    cols = _empty_columns(len(tokens))
    seqs = tokens["seq"].to_numpy()
    for seq in pd.unique(seqs):
        at = np.flatnonzero(seqs == seq)
        rows = torch.from_numpy(tokens["pos"].to_numpy()[at].astype(np.int64) - 1)
        _fill(cols, at, tokens, train_rows(int(seq))[rows], infer_rows(int(seq))[rows], k)
    return tokens.assign(**cols)


def row_columns(tokens: pd.DataFrame, train: torch.Tensor, infer: torch.Tensor, k: int = TOP_K) -> pd.DataFrame:
    """``tokens`` with COLUMNS added, from one row per table row (``rl --full-vocab``: the step's generated tokens).

    Args:
        tokens: token_diff.compare_tokens output (token_id, lp_train, lp_infer; n rows).
        train, infer: float32 [n, V]; row i scores table row i's token.
    Raises:
        ValueError: the rows are not [n, V] each (position_divergence).
    """
    if train.shape[0] != len(tokens):
        raise ValueError(f"row_columns: {train.shape[0]} rows for {len(tokens)} tokens")
    cols = _empty_columns(len(tokens))
    _fill(cols, np.arange(len(tokens)), tokens, train, infer, k)
    return tokens.assign(**cols)


BOOL_COLUMNS = ("vocab_top1_agree", "vocab_nonfinite", "vocab_row_matches_train", "vocab_row_matches_infer")


def _empty_columns(n: int) -> dict[str, np.ndarray]:
    return {c: np.zeros(n, dtype=bool if c in BOOL_COLUMNS else np.float64) for c in COLUMNS}


def _fill(cols: dict, at: np.ndarray, tokens: pd.DataFrame, a: torch.Tensor, b: torch.Tensor, k: int) -> None:
    """COLUMNS at table rows ``at`` from the row pairs a, b (float32 [len(at), V]): the measures, and whether each
    row's entry at the token is bit for bit the logprob that side recorded."""
    ids = torch.from_numpy(tokens["token_id"].to_numpy()[at].astype(np.int64))
    m = position_divergence(a, b, k)
    for name in ("kl_train_infer", "kl_infer_train", "tv", "top1_agree", "topk_overlap", "nonfinite"):
        cols[f"vocab_{name}"][at] = m[name]
    for side, r in (("train", a), ("infer", b)):
        picked = r.gather(1, ids[:, None])[:, 0].numpy().view(np.int32)
        reported = tokens[f"lp_{side}"].to_numpy(np.float32)[at].view(np.int32)
        cols[f"vocab_row_matches_{side}"][at] = picked == reported


def summarize_vocab(tokens: pd.DataFrame, k: int = TOP_K) -> dict:
    """The ``vocab`` record of a ``vocab_columns`` table: per measure the mean and max over finite positions and where
    the max is (seq, pos; the first such position), top-1 agreement and top-k overlap over finite positions,
    and the counts of nonfinite positions, infinite KLs and rows whose entry at the token is not the capture's
    logprob. Values are floats in nats (KL) or fractions; None where no position is finite."""
    n = len(tokens)
    ok = ~tokens["vocab_nonfinite"].to_numpy(dtype=bool)
    record: dict = {"positions": n, "k": k, "nonfinite_positions": int((~ok).sum())}
    seq, pos = tokens["seq"].to_numpy(), tokens["pos"].to_numpy()
    infinite = 0
    for name, column in MEASURES.items():
        x = tokens[column].to_numpy(dtype=np.float64)
        finite = ok & np.isfinite(x)
        infinite += int((ok & np.isinf(x)).sum()) if name != "tv" else 0
        if finite.any():
            i = int(np.flatnonzero(finite)[np.argmax(x[finite])])
            record[name] = {
                "mean": float(x[finite].mean()),
                "max": float(x[i]),
                "max_at": {"seq": int(seq[i]), "pos": int(pos[i])},
            }
        else:
            record[name] = {"mean": None, "max": None, "max_at": None}
    record["infinite_kl"] = infinite
    top1 = tokens["vocab_top1_agree"].to_numpy(dtype=bool)[ok]
    overlap = tokens["vocab_topk_overlap"].to_numpy(dtype=np.float64)[ok]
    record["top1_agreement"] = float(top1.mean()) if ok.any() else None
    record["topk_overlap_mean"] = float(overlap.mean()) if ok.any() else None
    record["topk_overlap_min"] = float(overlap.min()) if ok.any() else None
    record["row_token_mismatches"] = {
        side: int((~tokens[f"vocab_row_matches_{side}"].to_numpy(dtype=bool)).sum()) for side in ("train", "infer")
    }
    return record


def step_columns(record: dict) -> dict:
    """``rl --full-vocab``: steps.parquet's full-vocabulary columns from a summarize_vocab record over a step's
    generated tokens: ``vocab_<measure>_mean`` / ``_max`` for KL(train || infer), KL(infer || train) and total
    variation (nats, fractions; NaN where no position is finite), ``vocab_top1_agreement``, ``vocab_top5_overlap``
    (its mean), ``vocab_nonfinite_positions`` and ``vocab_infinite_kl`` (counts)."""
    out = {}
    for name, column in MEASURES.items():
        for stat in ("mean", "max"):
            value = record[name][stat]
            out[f"{column}_{stat}"] = float("nan") if value is None else value
    for column, key in (
        ("vocab_top1_agreement", "top1_agreement"),
        (f"vocab_top{record['k']}_overlap", "topk_overlap_mean"),
    ):
        out[column] = float("nan") if record[key] is None else record[key]
    out["vocab_nonfinite_positions"] = record["nonfinite_positions"]
    out["vocab_infinite_kl"] = record["infinite_kl"]
    return out
