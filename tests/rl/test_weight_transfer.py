"""The RL weight sync's measurements and checks (alignaudit.engines.weight_transfer), on known bit patterns;
the CUDA IPC transport between two real processes where a GPU is present."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from alignaudit.engines import weight_transfer as wt


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(37, generator=g).to(torch.bfloat16),
        "c.scale": torch.randn(5, generator=g),
    }


def _flip_lowest_bit(t: torch.Tensor, index: int) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1).view(wt._BITS[t.element_size()])
    flat[index] ^= 1
    return out


def test_update_stats_counts_changed_bit_patterns_and_the_largest_step():
    held = _weights()
    new = {k: v.clone() for k, v in held.items()}
    new["a.weight"] = _flip_lowest_bit(new["a.weight"], 7)
    new["a.weight"].view(-1)[100] = held["a.weight"].view(-1)[100] + 1.0  # one element moved by ~1
    new["c.scale"] = _flip_lowest_bit(new["c.scale"], 4)
    stats = wt.update_stats(held, new)
    assert stats["elements"] == 64 * 48 + 37 + 5 and stats["changed"] == 3
    moved = (new["a.weight"].view(-1)[100].float() - held["a.weight"].view(-1)[100].float()).abs()
    assert stats["max_abs_dw"] == float(moved) and 0.9 < stats["max_abs_dw"] < 1.1
    assert wt.update_stats(held, {k: v.clone() for k, v in held.items()}) == {
        "elements": 64 * 48 + 37 + 5,
        "changed": 0,
        "max_abs_dw": 0.0,
    }


def test_update_stats_over_chunks(monkeypatch):
    monkeypatch.setattr(wt, "CHUNK", 10)  # the chunked loop, with a partial last chunk
    held = _weights()
    new = {k: _flip_lowest_bit(v, v.numel() - 1) for k, v in held.items()}
    assert wt.update_stats(held, new)["changed"] == 3


def test_differing_names_every_tensor_that_is_not_bit_identical():
    held = _weights()
    sent = {k: v.clone() for k, v in held.items()}
    assert wt.differing(held, sent) == []
    sent["b.weight"] = _flip_lowest_bit(sent["b.weight"], 36)
    sent["extra"] = torch.zeros(2)
    sent["c.scale"] = sent["c.scale"].double()
    assert wt.differing(held, sent) == ["b.weight", "c.scale", "extra"]
    nan = {"x": torch.tensor([float("nan")])}
    assert wt.differing(nan, {"x": torch.tensor([float("nan")])}) == []  # bits, not values: NaN == NaN here


def test_fingerprint_sees_one_flipped_bit_a_moved_element_and_metadata(monkeypatch):
    base = _weights()
    ref = wt.fingerprint(base)
    assert wt.fingerprint({k: v.clone() for k, v in base.items()}) == ref
    assert wt.fingerprint({**base, "a.weight": _flip_lowest_bit(base["a.weight"], 0)}) != ref
    swapped = base["a.weight"].clone().view(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not torch.equal(swapped, base["a.weight"].view(-1))
    assert wt.fingerprint({**base, "a.weight": swapped.view(64, 48)}) != ref  # position matters
    assert wt.fingerprint({**base, "a.weight": base["a.weight"].reshape(48, 64)}) != ref  # shape matters
    assert (
        wt.fingerprint({"renamed": base["a.weight"], "b.weight": base["b.weight"], "c.scale": base["c.scale"]}) != ref
    )
    monkeypatch.setattr(wt, "CHUNK", 7)
    assert wt.fingerprint(base) == ref  # the chunking is not part of the value


def test_share_refuses_host_tensors():
    with pytest.raises(ValueError, match="a.weight is on cpu, not a CUDA device"):
        wt.share(_weights())


CONSUMER = """
import sys, torch
from alignaudit.engines import weight_transfer as wt
received = wt.receive(sys.stdin.read())
expected = {"a": torch.arange(12, device="cuda", dtype=torch.float32).view(3, 4).to(torch.bfloat16),
            "b": torch.arange(6, device="cuda", dtype=torch.float32)[::2]}
print(wt.differing(received, expected), received["b"].stride(), wt.fingerprint(received))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_hands_the_producers_memory_to_another_process():
    tensors = {
        "a": torch.arange(12, device="cuda", dtype=torch.float32).view(3, 4).to(torch.bfloat16),
        "b": torch.arange(6, device="cuda", dtype=torch.float32)[::2],
    }  # a strided view shares too
    proc = subprocess.run(
        [sys.executable, "-c", CONSUMER], input=wt.share(tensors), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "(2,)", wt.fingerprint(tensors)]
