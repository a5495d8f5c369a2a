"""Strict kernels, log_softmax and token logprobs: batch invariance, a real vocabulary, exact sums independent of the
caller's buffer and the vocabulary order, NaN handling, the vocabulary-parallel form over ranks; Megatron's
formula as the negative control.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import alignaudit_kernels as K
from alignaudit_kernels import logprobs, primitives
from helpers import (
    EXAMPLES,
    INTERPRET,
    assert_bitwise_equal,
    assert_within,
    gen,
    randn,
)


@EXAMPLES
@given(seed=st.integers(0, 10**6))
def test_log_softmax_batch_invariant_and_gather_consistent(device, dtype, seed):
    v = 5000
    logits = randn(257, v, dtype=dtype, device=device, seed=seed, scale=4)
    targets = torch.randint(0, v, (257,), generator=gen(seed)).to(device)
    full = K.log_softmax(logits)
    assert full.dtype == torch.float32
    picked = K.token_logprobs(logits, targets)
    assert_bitwise_equal("token_logprobs vs log_softmax", picked, full.gather(1, targets[:, None])[:, 0])
    for i in (0, 128, 256):
        assert_bitwise_equal(f"row {i}", K.token_logprobs(logits[i : i + 1], targets[i : i + 1])[0], picked[i])
    ref = logprobs.reference(logits.double())
    assert_within("log_softmax", full, ref, 4 * 2**-23 * (ref.abs() + 8))


def test_log_softmax_and_token_logprobs_agree_at_a_real_vocabulary(device):
    """A rollout engine's logprobs come from log_softmax (vLLM's compute_logprobs), a trainer's from
    token_logprobs: one bit pattern at Qwen3's vocabulary, for rows scored in batches of different sizes
    (so the vocabulary is split between programs differently)."""
    v = 151936
    # the interpreter splits every row into INTERPRETER_SPLITS chunks whatever the batch, so 6 rows there
    # cover what 96 do (its numpy loop over a real vocabulary took 108 s for 96 rows on the CI machine)
    rows, batches = (6, ((0, 1), (1, 3), (3, 6))) if INTERPRET else (96, ((0, 1), (1, 40), (40, 96)))
    logits = randn(rows, v, dtype=torch.bfloat16, device=device, seed=21, scale=3)
    targets = torch.randint(0, v, (rows,), generator=gen(22)).to(device)
    trainer = K.token_logprobs(logits, targets)
    for a, b in batches:
        rollout = K.log_softmax(logits[a:b]).gather(1, targets[a:b, None])[:, 0]
        assert_bitwise_equal(f"log_softmax rows {a}:{b} vs token_logprobs", rollout, trainer[a:b])


def test_reductions_do_not_depend_on_the_callers_buffer(device, dtype):
    """The same values from a misaligned view, and logits from an fp32 copy, give the same bits: on the
    H200 the Triton reductions' order followed the load width (HF's generate hands the sampler fp32
    copies of bf16 logits; the trainer rescored the bf16 ones: 1-2 ULP on 1-5 of 64 sampled tokens)."""
    v, h = 5000, 160
    logits = randn(8, v, dtype=dtype, device=device, seed=13, scale=4)
    targets = torch.randint(0, v, (8,), generator=gen(14)).to(device)
    base = K.token_logprobs(logits, targets)
    assert_bitwise_equal("fp32 copy of the logits", K.token_logprobs(logits.float(), targets), base)
    assert_bitwise_equal("log_softmax of the fp32 copy", K.log_softmax(logits.float()), K.log_softmax(logits))
    assert_bitwise_equal("misaligned logits", K.token_logprobs(misaligned(logits), targets), base)
    x, r = randn(8, h, dtype=dtype, device=device, seed=15), randn(8, h, dtype=dtype, device=device, seed=16)
    w = randn(h, dtype=dtype, device=device, seed=17, scale=0.2) + 1
    assert_bitwise_equal("misaligned rms_norm input", K.rms_norm(misaligned(x), w, 1e-6), K.rms_norm(x, w, 1e-6))
    unaligned, aligned = K.rms_norm(misaligned(x), w, 1e-6, residual=misaligned(r)), K.rms_norm(x, w, 1e-6, residual=r)
    for a, b in zip(unaligned, aligned, strict=True):
        assert_bitwise_equal("misaligned fused add + rms_norm", a, b)


@EXAMPLES
@given(seed=st.integers(0, 10**6))
def test_logprobs_do_not_depend_on_the_vocabulary_order(device, dtype, seed):
    """The normalizer is an exact sum: permuting the vocabulary permutes log_softmax bit for bit, and every
    backend gives the bits of the CPU definition (max, exp, unit_sum, log)."""
    v = 5000
    logits = randn(33, v, dtype=dtype, device=device, seed=seed, scale=4)
    perm = torch.randperm(v, generator=gen(seed + 1))
    full = K.log_softmax(logits)
    assert_bitwise_equal("permuted vocabulary", K.log_softmax(logits[:, perm.to(device)]), full[:, perm.to(device)])
    l = logits.float().cpu()
    z = l - l.amax(-1, keepdim=True)
    assert_bitwise_equal(
        "the CPU definition", full.cpu(), z - primitives.log(primitives.unit_sum(primitives.exp(z)))[:, None]
    )
    float_sum = z - primitives.log(primitives.fixed_sum(primitives.exp(z)))[:, None]
    z_perm = z[:, perm]
    assert not torch.equal(
        z_perm - primitives.log(primitives.fixed_sum(primitives.exp(z_perm)))[:, None], float_sum[:, perm]
    )  # negative control: a float sum follows the order


def test_logprobs_are_nan_where_a_logit_is_nan_or_inf(device):
    """A NaN or +inf logit, or a row of -inf, makes its whole row NaN (never a finite logprob that hides it);
    the other rows keep the bits they have alone."""
    logits = randn(4, 5000, dtype=torch.float32, device=device, seed=21, scale=4)
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    targets = torch.tensor([3, 4, 5, 6], device=device)
    full, picked = K.log_softmax(logits), K.token_logprobs(logits, targets)
    assert full.isnan().all(-1).tolist() == [False, True, True, True]
    assert picked.isnan().tolist() == [False, True, True, True]
    assert_bitwise_equal("finite row", full[0], K.log_softmax(logits[:1])[0])


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x whose first element sits one element past a 16-byte boundary."""
    buffer = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = buffer[1:].view(x.shape)
    assert view.data_ptr() % 16 != 0
    return view.copy_(x)


def test_logprob_negative_control_megatron_formula():
    """Megatron's cross-entropy (log(sum) - (l - max)) and torch.log_softmax differ in the last bit."""
    logits = randn(300, 5000, dtype=torch.float32, device="cpu", seed=11, scale=4)
    t = torch.randint(0, 5000, (300,), generator=gen(12))
    m = logits.max(-1).values
    megatron = -(torch.log(torch.exp(logits - m[:, None]).sum(-1)) - (logits.gather(1, t[:, None])[:, 0] - m))
    assert not torch.equal(megatron, torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0])
