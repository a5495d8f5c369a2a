"""Full-vocabulary rows (compare --full-vocab) from the real engines on the fixture, and what the comparison makes of
them. The captures are the plain prompt captures every engine test shares (CaptureCache writes their rows).

Chain of reasoning:
1. Each engine's rows are the rows its own token logprobs come from: every row's entry at the next token is bit for
   bit the logprob the capture recorded (Megatron: -loss of its cross-entropy; vLLM: its prompt logprobs; HF: TRL's
   gather), checked here straight from the files.
2. The rows are the model's next-token distributions at the right positions: HF's fp32 rows are within 1e-9 nats
   (KL) of the fixture model run in float64 in this process, and the same rows one position off are not.
3. The comparison's KL, TV, top-1 and top-5 per token, and the summary's means, maxima and their positions, equal a
   numpy float64 computation written in the test (helpers.vocab_reference) from the saved rows, and, for HF, from
   logits recomputed in this process.
4. Under --strict the engines' rows are bit for bit equal, so KL = TV = 0 exactly; without it (the negative
   control) every position's KL is > 0.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from alignaudit.capture.directory import read_capture
from alignaudit.comparison.integrity import load_run
from alignaudit.errors import InputError
from alignaudit.pipelines.runs import diff_captures, finish_diff
from helpers import FIXTURE, assert_bitwise_equal, saved_vocab_rows, vocab_reference

pytestmark = pytest.mark.engines

VOCAB = 512  # the fixture's vocabulary


@pytest.fixture(scope="module")
def diff(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-diffs")

    def run(a, b):
        out = root / f"{a.path.name}-vs-{b.path.name}"
        summary = diff_captures(a, b, out)
        return summary, pd.read_parquet(out / "tokens.parquet")

    return run


def positions(capture):
    """Per sequence: (row index per scored token, next-token ids, recorded logprobs), from the capture's table."""
    table = capture.logprobs[capture.logprobs["scored"]].sort_values(["seq", "pos"])
    return {
        int(s): (g["pos"].to_numpy() - 1, g["token_id"].to_numpy(np.int64), g["logprob"].to_numpy(np.float32).copy())
        for s, g in table.groupby("seq")
    }


def reference_from(train_rows, infer_rows, capture) -> dict[str, np.ndarray]:
    """helpers.vocab_reference over every scored token, in the tokens table's order (seq, pos)."""
    parts = [
        vocab_reference(train_rows(s)[rows].numpy(), infer_rows(s)[rows].numpy())
        for s, (rows, _, _) in sorted(positions(capture).items())
    ]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def assert_matches_reference(summary: dict, tokens: pd.DataFrame, ref: dict) -> None:
    for name in ("kl_train_infer", "kl_infer_train", "tv"):
        np.testing.assert_allclose(tokens[f"vocab_{name}"], ref[name], rtol=1e-9, atol=1e-15, err_msg=name)
        record = summary["vocab"][name]
        assert record["mean"] == pytest.approx(ref[name].mean(), rel=1e-9)
        assert record["max"] == pytest.approx(ref[name].max(), rel=1e-9)
        i = int(np.argmax(ref[name]))
        assert record["max_at"] == {"seq": int(tokens["seq"][i]), "pos": int(tokens["pos"][i])}
    assert np.array_equal(tokens["vocab_top1_agree"], ref["top1_agree"])
    assert np.array_equal(tokens["vocab_topk_overlap"], ref["topk_overlap"])
    assert summary["vocab"]["top1_agreement"] == ref["top1_agree"].mean()
    assert summary["vocab"]["topk_overlap_mean"] == pytest.approx(ref["topk_overlap"].mean(), rel=1e-12)
    assert summary["vocab"]["topk_overlap_min"] == ref["topk_overlap"].min()


@pytest.mark.parametrize("engine", ["megatron", "vllm", "hf"])
@pytest.mark.parametrize("strict", ["", "all"])
def test_rows_are_the_rows_the_engines_logprobs_come_from(captures, engine, strict):
    capture = captures.get(engine, "bf16", strict=strict)
    assert capture.manifest["vocab"]["vocab_size"] == VOCAB
    assert ("alignaudit_kernels.log_softmax" in capture.manifest["vocab"]["rows"]) == bool(strict)
    for seq, (rows, ids, logprobs) in positions(capture).items():
        saved = saved_vocab_rows(capture, seq)
        assert saved.dtype == torch.float32 and saved.shape == (len(rows), VOCAB)
        picked = saved[torch.from_numpy(rows.astype(np.int64)), torch.from_numpy(ids)]
        assert_bitwise_equal(
            f"{engine} seq {seq}: row entry at the next token vs the logprob", picked, torch.from_numpy(logprobs)
        )
        assert (saved.double().exp().sum(-1) - 1).abs().max() < 1e-5


def test_megatron_vs_vllm_default_diverges_at_every_position_as_computed_independently(captures, diff):
    train, infer = captures.get("megatron", "bf16"), captures.get("vllm", "bf16")
    summary, tokens = diff(train, infer)
    ref = reference_from(lambda s: saved_vocab_rows(train, s), lambda s: saved_vocab_rows(infer, s), train)
    assert_matches_reference(summary, tokens, ref)
    assert len(tokens) == summary["vocab"]["positions"] == 176
    assert (ref["kl_train_infer"] > 0).all() and (ref["kl_infer_train"] > 0).all() and (ref["tv"] > 0).all()
    assert summary["vocab"]["row_token_mismatches"] == {"train": 0, "infer": 0}
    assert summary["vocab"]["nonfinite_positions"] == summary["vocab"]["infinite_kl"] == 0
    assert "vocab_parallel_cross_entropy" in summary["vocab"]["rows"]["train"]
    assert "Sampler.compute_logprobs" in summary["vocab"]["rows"]["infer"]


@pytest.mark.parametrize("train_engine, infer_engine", [("megatron", "vllm"), ("hf", "vllm")])
def test_strict_rows_are_bit_equal_so_kl_and_tv_are_exactly_zero(captures, diff, train_engine, infer_engine):
    train, infer = captures.get(train_engine, "bf16", strict="all"), captures.get(infer_engine, "bf16", strict="all")
    for seq in range(4):
        assert_bitwise_equal(f"strict rows of seq {seq}", saved_vocab_rows(train, seq), saved_vocab_rows(infer, seq))
    summary, tokens = diff(train, infer)
    v = summary["vocab"]
    for name in ("kl_train_infer", "kl_infer_train", "tv"):
        assert v[name]["max"] == 0.0 and v[name]["mean"] == 0.0 and (tokens[f"vocab_{name}"] == 0).all()
    assert v["top1_agreement"] == 1.0 and v["topk_overlap_min"] == 1.0 and v["positions"] == 176


def test_hf_rows_recomputed_in_process_and_against_a_float64_model(captures, diff):
    """HF bf16 vs vLLM bf16 checked from HF logits this test computes itself; HF's fp32 rows against the fixture run
    in float64 (tiny KL at the right positions, large one position off)."""
    from transformers import AutoModelForCausalLM

    hf, vllm = captures.get("hf", "bf16"), captures.get("vllm", "bf16")
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16, attn_implementation="eager").eval()
    sequences = hf.token_batch().sequences
    with torch.no_grad():
        recomputed = {
            s: torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
            for s, seq in enumerate(sequences)
        }
        model64 = model.double()
        exact = {
            s: torch.log_softmax(model64(torch.tensor([seq])).logits[0, :-1], -1) for s, seq in enumerate(sequences)
        }
    summary, tokens = diff(hf, vllm)
    ref = reference_from(recomputed.__getitem__, lambda s: saved_vocab_rows(vllm, s), hf)
    assert_matches_reference(summary, tokens, ref)
    fp32 = captures.get("hf", "fp32")
    for s in range(len(sequences)):
        assert (recomputed[s] - saved_vocab_rows(hf, s)).abs().max() < 1e-6  # same arithmetic, maybe other threads
        rows64, saved = exact[s].numpy(), saved_vocab_rows(fp32, s).numpy().astype(np.float64)
        saved -= np.log(np.exp(saved).sum(-1, keepdims=True))  # renormalized, as the comparison does
        p = np.exp(rows64)
        kl = (p * (rows64 - saved)).sum(-1)
        shifted = (p[1:] * (rows64[1:] - saved[:-1])).sum(-1)
        assert -1e-12 < kl.min() and kl.max() < 1e-9, (kl.min(), kl.max())
        assert np.median(shifted) > 1e3 * kl.max(), (np.median(shifted), shifted.min())


def test_damaged_rows_are_refused_not_compared(captures, tmp_path):
    """Copies of two strict captures, sealed as a diff run, then one row file changed by one byte: diff, gate and
    report refuse (the manifest's sha256), never compare it; a row file removed: reading the capture refuses."""
    copies = {}
    for role, engine in (("train", "megatron"), ("infer", "vllm")):
        copies[role] = tmp_path / role
        shutil.copytree(captures.get(engine, "bf16", strict="all").path, copies[role])
    train, infer = read_capture(copies["train"]), read_capture(copies["infer"])
    out = tmp_path / "diff"
    diff_captures(train, infer, out)
    finish_diff(out, train, infer, 0.2)
    assert load_run(out).record["command"] == "diff"
    row = copies["infer"] / "vocab" / "seq-00002.safetensors"
    data = bytearray(row.read_bytes())
    data[-3] ^= 1
    row.write_bytes(bytes(data))
    with pytest.raises(InputError, match="seq-00002.safetensors is missing or does not match the manifest's sha256"):
        load_run(out)
    with pytest.raises(InputError, match="does not match the manifest's sha256"):
        diff_captures(train, read_capture(copies["infer"]), tmp_path / "again")
    (copies["train"] / "vocab" / "seq-00001.safetensors").unlink()
    with pytest.raises(InputError, match="seq-00001.safetensors is missing"):
        read_capture(copies["train"])
    manifest = json.loads((copies["infer"] / "manifest.json").read_text())
    assert sorted(manifest["vocab"]["files"]) == [f"seq-{s:05d}.safetensors" for s in range(4)]
