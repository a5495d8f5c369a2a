"""Pure pieces of op capture: layouts, selections, the vLLM row mapping, the on-disk op store."""

from __future__ import annotations

import pytest
import torch

from alignaudit.capture.op_store import OpRecorder, OpStore
from alignaudit.capture.ops import OpGraph, Selection, parse_selection
from alignaudit.comparison.op_diff import compare_op, routing_agreement
from alignaudit.engines.layouts import fuse_qkv_grouped, split_qkv_grouped
from alignaudit.engines.taps import BATCH_FIRST, FLAT, SEQ_FIRST, Routing, RowSpan, put_rows, take_rows
from alignaudit.engines.vllm.taps import StepRows, _slice_spans
from alignaudit.errors import InputError


def test_megatron_qkv_grouping_matches_its_definition():
    nh, ng, hd = 8, 2, 4
    q = torch.arange(nh * hd).float()
    k = 1000 + torch.arange(ng * hd).float()
    v = 2000 + torch.arange(ng * hd).float()
    fused = fuse_qkv_grouped(q, k, v, ng, dim=0)
    per_group = fused.view(ng, (nh // ng + 2) * hd)  # Megatron: [q heads of group | k | v] per group
    for g in range(ng):
        assert torch.equal(per_group[g, : nh // ng * hd], q.view(ng, -1)[g])
        assert torch.equal(per_group[g, nh // ng * hd : nh // ng * hd + hd], k.view(ng, hd)[g])
        assert torch.equal(per_group[g, -hd:], v.view(ng, hd)[g])
    rows = torch.stack([fused, fused + 1])
    q2, k2, v2 = split_qkv_grouped(rows, nh, ng, hd)
    assert torch.equal(q2[0], q) and torch.equal(k2[1], k + 1) and torch.equal(v2[0], v)


def test_selection_parsing_and_inputs():
    graph = OpGraph(4)
    sel = parse_selection("0-1,3", "attn,o_proj", graph)
    assert sel.op_ids(graph) == [
        "layers.0.attn",
        "layers.0.o_proj",
        "layers.1.attn",
        "layers.1.o_proj",
        "layers.3.attn",
        "layers.3.o_proj",
    ]
    assert graph.inputs("layers.3.attn") == ["layers.3.q_rope", "layers.3.k_rope", "layers.3.v_proj"]
    assert graph.inputs("layers.0.input_norm") == ["embed"]
    assert graph.inputs("layers.2.attn_residual") == ["layers.1.mlp_residual", "layers.2.o_proj"]
    assert graph.inputs("final_norm") == ["layers.3.mlp_residual"]
    wide = sel.with_inputs(graph)
    assert wide.wants("layers.3.q_rope") and wide.wants("layers.3.attn") and not wide.wants("layers.2.attn")
    assert Selection.from_dict(wide.to_dict()) == wide
    assert len(OpGraph(2).op_ids()) == 1 + 2 * 17 + 2 + 1
    for bad, message in (("0-9", "layers 0-3"), ("a", "ranges"), ("2-1", "runs backwards; write 1-2")):
        with pytest.raises(InputError, match=message):
            parse_selection(bad, None, graph)
    with pytest.raises(InputError, match="unknown op"):
        parse_selection(None, "softmax", graph)


def test_a_mixture_of_experts_layer_has_router_routing_and_moe_in_place_of_the_dense_mlp():
    graph = OpGraph(2, qk_norm=True, moe=True)
    layer = [op.split(".", 2)[2] for op in graph.op_ids() if op.startswith("layers.0.")]
    assert layer[layer.index("post_attn_norm") :] == ["post_attn_norm", "router", "routing", "moe", "mlp_residual"]
    assert len(graph.op_ids()) == 1 + 2 * 16 + 2 + 1
    assert graph.inputs("layers.1.mlp_residual") == ["layers.1.attn_residual", "layers.1.moe"]
    assert graph.inputs("layers.0.routing") == ["layers.0.router"]
    assert graph.inputs("layers.0.moe") == ["layers.0.post_attn_norm"]  # the whole layer, routing included
    with pytest.raises(InputError, match="a mixture of experts; its ops: .*router, routing, moe"):
        parse_selection(None, "down_proj", graph)
    with pytest.raises(InputError, match="a dense MLP"):
        parse_selection(None, "routing", OpGraph(2))


def test_routing_is_compared_as_a_set_per_token():
    ids = torch.tensor([[3, 1], [7, 3], [0, 5]])
    (train,) = Routing().split(ids, None)
    assert train.tolist() == [[1, 3], [3, 7], [0, 5]]  # ascending: the set, not the engine's order
    routing_map = torch.zeros(3, 8, dtype=torch.bool)
    routing_map[0, [1, 3]] = routing_map[1, [3, 7]] = routing_map[2, [0, 6]] = True  # Megatron's form
    (infer,) = Routing().split(routing_map, None)
    record = compare_op("layers.1.routing", {0: train}, {0: infer})
    assert (record["status"], record["rerouted"], record["elements"]) == ("differs", 1, 3)
    assert record["worst"] == {"seq": 0, "pos": 2, "train_experts": [0, 5], "infer_experts": [0, 6]}
    assert routing_agreement([record]) == [{"layer": 1, "tokens": 3, "rerouted": 1, "agreement": 2 / 3}]


def test_rows_in_each_engine_layout():
    x = torch.arange(2 * 5 * 3).view(2, 5, 3)  # [batch, tokens, features]
    span = RowSpan(seq=7, pos_start=0, length=4, batch_row=1)
    assert torch.equal(take_rows(x, span, BATCH_FIRST), x[1, :4])
    assert torch.equal(take_rows(x.transpose(0, 1), span, SEQ_FIRST), x[1, :4])
    flat = x.reshape(10, 3)
    assert torch.equal(take_rows(flat, RowSpan(7, 2, 3, None, 6), FLAT), flat[6:9])
    y = x.clone()
    put_rows(y, span, BATCH_FIRST, torch.zeros(4, 3, dtype=x.dtype))
    assert int(y[1, :4].abs().sum()) == 0 and torch.equal(y[0], x[0]) and torch.equal(y[1, 4], x[1, 4])


def test_vllm_step_rows_follow_requests_across_chunks():
    seqs = ((5, 6, 7, 8), (5, 6, 9), (1, 2))
    rows = StepRows(seqs)
    # step 1: request 1 whole, then the first two tokens of request 0 (chunked prefill); both start 5, 6
    spans = rows.spans(torch.tensor([5, 6, 9, 5, 6]), torch.tensor([0, 1, 2, 0, 1]))
    assert [(s.seq, s.pos_start, s.length, s.row_start) for s in spans] == [(1, 0, 3, 0), (0, 0, 2, 3)]
    # step 2: the rest of request 0 and all of request 2
    spans = rows.spans(torch.tensor([7, 8, 1, 2]), torch.tensor([2, 3, 0, 1]))
    assert [(s.seq, s.pos_start, s.length, s.row_start) for s in spans] == [(0, 2, 2, 0), (2, 0, 2, 2)]
    with pytest.raises(RuntimeError, match="matches no prompt"):
        rows.spans(torch.tensor([4]), torch.tensor([0]))


def test_logit_rows_are_found_by_storage_offset():
    base = torch.randn(10, 4)
    step = [RowSpan(0, 0, 6, None, 0), RowSpan(1, 0, 4, None, 6)]
    spans = _slice_spans(step, base, base[6:9])
    assert [(s.seq, s.pos_start, s.length, s.row_start) for s in spans] == [(1, 0, 3, 0)]
    assert _slice_spans(step, base, base[[0, 6]]) == []  # a gathered copy (the sampling call)


def test_op_store_streams_chunks_and_reads_back(tmp_path):
    rec = OpRecorder(tmp_path, flush_bytes=30)  # every chunk goes to disk at once
    a = torch.randn(5, 8, dtype=torch.bfloat16)
    rec.record("layers.0.attn", 0, 0, a[:3])
    rec.record("layers.0.attn", 0, 3, a[3:])
    rec.record("layers.0.attn", 1, 0, a[:2])
    with pytest.raises(RuntimeError, match="expected 2"):
        rec.record("layers.0.attn", 1, 5, a[:1])
    summary = rec.finish()
    assert summary["files"] == 3 and summary["ops"] == 1 and summary["op_ids"] == ["layers.0.attn"]
    store = OpStore(tmp_path, summary)
    got = store.sequences("layers.0.attn")
    assert torch.equal(got[0].view(torch.int16), a.view(torch.int16)) and got[1].shape == (2, 8)
    assert store.fingerprint("layers.0.attn", 0) != store.fingerprint("layers.0.attn", 1)
    assert torch.equal(store.rows("layers.0.attn", 0, 1, 2), a[1:3])
    with pytest.raises(InputError, match="no per-op tensors"):
        OpStore(tmp_path / "nothing", summary)
    with pytest.raises(InputError, match="records no sha256 of ops/index.parquet"):
        OpStore(tmp_path, {})


def test_an_op_removed_from_the_index_is_missing_not_skipped(tmp_path):
    """The index lost one op's rows: with its checksum recomputed too, the op list the manifest recorded
    still names it, so the store refuses instead of letting the first divergence move to the next op."""
    import hashlib

    import pandas as pd

    rec = OpRecorder(tmp_path)
    for op in ("layers.0.input_norm", "layers.0.q_proj"):
        rec.record(op, 0, 0, torch.randn(3, 8))
    summary = rec.finish()
    index = tmp_path / "ops" / "index.parquet"
    table = pd.read_parquet(index)
    table[table["op"] != "layers.0.input_norm"].to_parquet(index, index=False)
    with pytest.raises(InputError, match="index.parquet is missing or is not the file the capture wrote"):
        OpStore(tmp_path, summary)
    summary["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    with pytest.raises(InputError, match="op layers.0.input_norm is missing"):
        OpStore(tmp_path, summary)


def test_numerics_flags_read_tf32_switches_set_per_backend_as_vllm_batch_invariance_sets_them():
    """vLLM's VLLM_BATCH_INVARIANT=1 sets TF32 per backend through torch's new API (init_batch_invariance:
    cuda.matmul, cudnn.conv, cudnn.rnn to "ieee"); torch then refuses the legacy reads (allow_tf32,
    get_float32_matmul_precision) with RuntimeError, which crashed every strict capture on the H200. The record
    reads the per-backend values and marks a refused legacy read, instead of raising."""
    from alignaudit.capture.environment import numerics_flags

    backends = torch.backends
    saved = [
        (backends.cuda.matmul, backends.cuda.matmul.fp32_precision),
        (backends.cudnn.conv, backends.cudnn.conv.fp32_precision),
        (backends.cudnn.rnn, backends.cudnn.rnn.fp32_precision),
    ]
    try:
        backends.cuda.matmul.fp32_precision = "ieee"
        backends.cudnn.conv.fp32_precision = "tf32"  # conv and rnn apart: the legacy cuDNN read must refuse
        backends.cudnn.rnn.fp32_precision = "ieee"
        with pytest.raises(RuntimeError):
            backends.cudnn.allow_tf32  # noqa: B018  (the read that crashed)
        flags = numerics_flags()
    finally:
        for owner, value in saved:
            owner.fp32_precision = value
    assert flags["fp32_precision"]["cuda_matmul"] == "ieee"
    assert flags["fp32_precision"]["cudnn_conv"] == "tf32" and flags["fp32_precision"]["cudnn_rnn"] == "ieee"
    assert flags["cudnn_allow_tf32"].startswith("unreadable: PyTorch is checking whether allow_tf32")
