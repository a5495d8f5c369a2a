"""Per-op comparison of two captures' canonical tensors. Pure: tensors in, records out.

Each record summarizes one op over all sequences both captures hold: fraction of bitwise-equal elements,
ULP distances, max |diff|, SGLang's rel_diff, NaN/Inf mismatches, and the worst element (largest ULP
distance, first on ties) with its coordinates (sequence, position, index within the token's tensor) and
both values in decimal and hex. When the engines stored an op in different dtypes, both sides are upcast
to the wider dtype (exact) and the record says so. When they computed it for different numbers of
positions (vLLM computes prompt logits for all but the last position), the common prefix is compared.
"""

from __future__ import annotations

import torch

from alignaudit import numerics
from alignaudit.capture.ops import split_op_id
from alignaudit.numerics import PairClass

EQUAL, DIFFERS, MISSING, SHAPE = "equal", "differs", "missing", "shape mismatch"


def compare_op(op: str, a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict:
    """Compare one op: ``a`` and ``b`` map sequence index -> canonical tensor [tokens, ...]."""
    name, layer = split_op_id(op)
    record: dict = {"op": op, "name": name, "layer": layer}
    seqs = sorted(set(a) & set(b))
    if not seqs:
        side = "both" if not a and not b else ("train" if not a else "infer")
        return {**record, "status": MISSING, "note": f"not captured by {side}"}
    if name == "routing":
        return {**record, **_compare_routing(seqs, a, b)}
    xs, ys, coords = [], [], []
    notes = set()
    for seq in seqs:
        x, y = a[seq], b[seq]
        if x.shape[1:] != y.shape[1:]:
            return {**record, "status": SHAPE, "note": f"seq {seq}: {tuple(x.shape)} vs {tuple(y.shape)}"}
        n = min(x.shape[0], y.shape[0])
        if x.shape[0] != y.shape[0]:
            notes.add(f"first {n} positions")
        if x.dtype != y.dtype:
            common = torch.promote_types(x.dtype, y.dtype)
            notes.add(f"{str(x.dtype)[6:]} vs {str(y.dtype)[6:]}, compared in {str(common)[6:]}")
            x, y = x.to(common), y.to(common)
        xs.append(x[:n].reshape(-1))
        ys.append(y[:n].reshape(-1))
        coords.append((seq, n, x.shape[1:]))
    x, y = torch.cat(xs), torch.cat(ys)
    cls = numerics.classify(x, y)
    ulp = numerics.ulp_distance(x, y)
    finite = cls <= PairClass.FINITE_DIFF
    equal = cls == PairClass.BITWISE_EQUAL
    finite_ulp = ulp[finite]
    diff = (x.double() - y.double()).abs()[finite]
    record.update(
        status=EQUAL if bool(equal.all()) else DIFFERS,
        dtype=str(x.dtype).removeprefix("torch."),
        elements=x.numel(),
        equal_fraction=float(equal.double().mean()),
        ulp_max=int(finite_ulp.max()) if finite_ulp.numel() else None,
        ulp_median=float(finite_ulp.double().median()) if finite_ulp.numel() else None,
        abs_max=float(diff.max()) if diff.numel() else None,
        rel_diff=numerics.rel_diff(x[finite], y[finite]) if finite.any() else None,
        nan_mismatches=int((cls == PairClass.NAN_MISMATCH).sum()),
        inf_mismatches=int((cls == PairClass.INF_MISMATCH).sum()),
        note="; ".join(sorted(notes)),
    )
    if record["status"] == DIFFERS:
        record["worst"] = _worst(x, y, ulp, cls, coords)
    return record


def _compare_routing(seqs: list[int], a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict:
    """Routing decisions (canonical ``routing`` rows: each token's experts, ascending) compared per token:
    ``equal_fraction`` is the routing agreement, the share of tokens sent to the same experts; ``rerouted``
    counts the others; ``worst`` is the first such token with both expert sets. No ULP: these are indices."""
    tokens = rerouted = 0
    worst = None
    for seq in seqs:
        n = min(a[seq].shape[0], b[seq].shape[0])
        x, y = a[seq][:n], b[seq][:n]
        if x.shape != y.shape:
            return {"status": SHAPE, "note": f"seq {seq}: {tuple(x.shape)} vs {tuple(y.shape)} experts per token"}
        differs = (x != y).any(dim=-1)
        tokens += n
        rerouted += int(differs.sum())
        if worst is None and bool(differs.any()):
            pos = int(differs.nonzero()[0])
            worst = {"seq": seq, "pos": pos, "train_experts": x[pos].tolist(), "infer_experts": y[pos].tolist()}
    record = {
        "status": DIFFERS if rerouted else EQUAL,
        "dtype": "int64",
        "elements": tokens,
        "rerouted": rerouted,
        "equal_fraction": (tokens - rerouted) / tokens if tokens else 1.0,
        "ulp_max": None,
        "ulp_median": None,
        "abs_max": None,
        "rel_diff": None,
        "nan_mismatches": 0,
        "inf_mismatches": 0,
        "note": "per token: the same experts",
    }
    if worst is not None:
        record["worst"] = worst
    return record


def routing_agreement(records: list[dict]) -> list[dict]:
    """Per MoE layer, from the ``routing`` records of ``compare_ops``: tokens, tokens sent to other experts
    (``rerouted``) and the agreement (share routed the same)."""
    return [
        {"layer": r["layer"], "tokens": r["elements"], "rerouted": r["rerouted"], "agreement": r["equal_fraction"]}
        for r in records
        if r["name"] == "routing" and "rerouted" in r
    ]


def _worst(x: torch.Tensor, y: torch.Tensor, ulp: torch.Tensor, cls: torch.Tensor, coords: list) -> dict:
    """The differing element with the largest ULP distance (NaN/Inf mismatches first), with coordinates."""
    score = torch.where(cls >= PairClass.NAN_MISMATCH, torch.iinfo(torch.int64).max, ulp)
    score = torch.where(cls == PairClass.BITWISE_EQUAL, -1, score)
    flat = int(score.argmax())
    offset = flat
    for seq, n, inner in coords:
        size = n * max(1, int(torch.tensor(inner).prod()) if len(inner) else 1)
        if offset < size:
            worst_seq = seq
            per_token = size // n
            pos, rest = divmod(offset, per_token)
            index = list(torch.unravel_index(torch.tensor(rest), tuple(inner))) if len(inner) else []
            break
        offset -= size
    return {
        "seq": worst_seq,
        "pos": pos,
        "index": [int(i) for i in index],
        "train": float(x[flat]),
        "infer": float(y[flat]),
        "train_hex": numerics.hex_bits(x[flat]),
        "infer_hex": numerics.hex_bits(y[flat]),
        "ulp": int(ulp[flat]),
    }


def first_divergence(records: list[dict]) -> dict | None:
    """The first record (topological order) whose tensors differ, or None."""
    return next((r for r in records if r["status"] == DIFFERS), None)
