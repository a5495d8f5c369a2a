"""Strict kernels, the strict ops' backward: against fp64 autograd, torch's own bf16 linear backward, per-sequence
attention gradients, autograd and no-grad entry points.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import pytest
import torch

import alignaudit_kernels as K
from alignaudit_kernels import attention, gradients, logprobs, matmul, rmsnorm, rope, silu
from alignaudit_kernels.attention import torch_reference
from helpers import (
    assert_bitwise_equal,
    gen,
    randn,
)


@pytest.mark.parametrize("backward", ["reference", "fused"])
def test_backward_matches_fp64_autograd(device, backward, monkeypatch):
    """Each strict op's gradients (fp32 inputs) within 2e-4 of fp64 autograd through its reference, by either
    ALIGNAUDIT_BACKWARD (CUDA's default is fused, the CPU's the reference)."""
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", backward)
    torch.manual_seed(0)
    dt = torch.float32

    def check(name, fn, ref_fn, *inputs, tol=2e-4):
        ours = [t.detach().to(device).requires_grad_() for t in inputs]
        theirs = [t.detach().double().requires_grad_() for t in inputs]
        out = fn(*ours)
        g = torch.randn(out.shape, generator=gen(99)).to(device)
        out.backward(g.to(out.dtype))
        ref_fn(*theirs).backward(g.double().cpu())
        for a, b in zip(ours, theirs, strict=True):
            err = float((a.grad.double().cpu() - b.grad).abs().max() / (b.grad.abs().max() + 1e-12))
            assert err < tol, f"{name}: relative gradient error {err:.2e}"

    x, w, b = torch.randn(7, 40, dtype=dt), torch.randn(24, 40, dtype=dt), torch.randn(24, dtype=dt)
    check("linear", K.linear, matmul.reference, x, w, b)
    check("rms_norm", lambda x, w: K.rms_norm(x, w, 1e-6), lambda x, w: rmsnorm.reference(x, w, 1e-6), x, w[0])
    check(
        "add_rms_norm",
        lambda x, r, w: torch.cat(K.rms_norm(x, w, 1e-6, residual=r), -1),
        lambda x, r, w: torch.cat(rmsnorm.reference(x, w, 1e-6, residual=r), -1),
        x,
        x.flip(0),
        w[0],
    )
    cos, sin = rope.rope_tables(64, 8, 1e4, device)
    pos = torch.arange(7).to(device)
    check(
        "rope",
        lambda x: K.apply_rope(x, pos, cos, sin),
        lambda x: rope.reference(x, pos.cpu(), cos.cpu().double(), sin.cpu().double()),
        x.view(7, 5, 8),
    )
    check("silu_mul", K.silu_mul, silu.reference, x, x.flip(1))
    check("log_softmax", K.log_softmax, logprobs.reference, x)
    t = torch.randint(0, 40, (7,))
    check(
        "token_logprobs",
        lambda x: K.token_logprobs(x, t.to(device)),
        lambda x: logprobs.reference(x).gather(1, t[:, None])[:, 0],
        x,
    )
    # three sequences, two of one length: the backward batches equal lengths through the reference
    q, k, v = torch.randn(13, 4, 8, dtype=dt), torch.randn(13, 2, 8, dtype=dt), torch.randn(13, 2, 8, dtype=dt)
    cu = torch.tensor([0, 4, 9, 13])

    def ref_attn(q, k, v):
        return torch.cat([attention.reference(q[a:b], k[a:b], v[a:b], 0.3) for a, b in ((0, 4), (4, 9), (9, 13))])

    check("varlen_attention", lambda q, k, v: K.varlen_attention(q, k, v, cu, 0.3), ref_attn, q, k, v)
    # causal_attention (HF's strict attention in a trainer): its forward once had no backward, and autograd
    # through the CPU kernel's primitives gave NaN gradients (an HF trainer's first update made every weight NaN)
    qb, kb, vb = (t[:8].reshape(2, 4, *t.shape[1:]) for t in (q, k, v))
    pos = torch.arange(4).expand(2, 4)

    def ref_batch(q, k, v):
        return torch.stack([attention.reference(q[i], k[i], v[i], 0.3, pos[i]) for i in range(2)])

    check("causal_attention", lambda q, k, v: K.causal_attention(q, k, v, pos.to(device), 0.3), ref_batch, qb, kb, vb)


def test_linear_backward_is_torchs_own_in_bf16(device):
    """The strict linear's backward runs the products of torch's own linear backward, in the inputs' dtype
    (not fp32: those were 0.55 of 0.95 s of a strict 1.7B update on the H200): in bf16 its gradients are
    bit-equal to autograd through F.linear, bias included, and dx is in x's dtype."""
    x, w, b = (
        randn(*shape, dtype=torch.bfloat16, device=device, seed=50 + i)
        for i, shape in enumerate(((2, 5, 64), (48, 64), (48,)))
    )
    g = randn(2, 5, 48, dtype=torch.bfloat16, device=device, seed=53)

    def grads(fn):
        ins = [t.clone().requires_grad_() for t in (x, w, b)]
        fn(*ins).backward(g)
        return [t.grad for t in ins]

    class Products(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("__matmul__", "matmul", "mm"):
                self.dtypes.add(tuple(a.dtype for a in args))
            return func(*args, **(kwargs or {}))

    with Products() as seen:  # the products of the function _Linear.backward calls
        matmul.linear_backward(g, x, w, has_bias=True)
    assert seen.dtypes == {(torch.bfloat16, torch.bfloat16)}, seen.dtypes
    ours, torchs = grads(K.linear), grads(torch.nn.functional.linear)
    for name, a, t in zip(("dx", "dw", "db"), ours, torchs, strict=True):
        assert a.dtype == torch.bfloat16, name
        if name == "db":  # summed in fp32 here; torch sums bf16 in its own order: to rounding
            torch.testing.assert_close(a, t, rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(a.view(torch.int16), t.view(torch.int16)), f"{name}: bits differ from torch's"


def test_attention_backward_takes_a_sequence_of_no_tokens(device):
    """A ragged batch may hold a sequence of no tokens (cu_seqlens repeats a bound): the backward gives the other
    sequences the gradients they get without it (it divided by its zero elements before)."""
    q, k, v = (torch.randn(7, h, 8, generator=gen(90 + i)) for i, h in enumerate((4, 2, 2)))

    def grads(cu):
        ins = [t.clone().to(device).requires_grad_() for t in (q, k, v)]
        K.varlen_attention(*ins, torch.tensor(cu), 0.3).pow(2).sum().backward()
        return [t.grad.cpu() for t in ins]

    for name, a, b in zip("qkv", grads([0, 3, 3, 7]), grads([0, 3, 7]), strict=True):
        assert_bitwise_equal(f"d{name}", a, b)


def test_attention_backward_gives_the_same_gradients_one_sequence_at_a_time(monkeypatch, device):
    """The backward batches sequences through the reference; with a budget of one element it takes them one
    at a time, and the gradients agree (fp32, to rounding: the batched products may sum in another order)."""
    q, k, v = (torch.randn(3, 6, h, 8, generator=gen(40 + i)) for i, h in enumerate((4, 2, 2)))
    pos = torch.arange(6).expand(3, 6)

    def grads():
        ins = [t.clone().to(device).requires_grad_() for t in (q, k, v)]
        K.causal_attention(*ins, pos.to(device), 0.3).pow(2).sum().backward()
        return [t.grad.cpu() for t in ins]

    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "reference")  # CUDA's default is fused
    batched = grads()
    monkeypatch.setattr(torch_reference, "REFERENCE_GRAD_ELEMENTS", 1)
    for name, a, b in zip("qkv", batched, grads(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")


def test_attention_backward_by_sdpa_agrees_with_the_reference(monkeypatch, device):
    """ALIGNAUDIT_BACKWARD=fused: torch's SDPA backward (is_causal for queries at 0..T-1, a mask for
    shifted ones, K/V expanded over GQA 4/2 and their gradients summed) gives the fp32 reference's gradients to
    fp32 rounding, for varlen (two lengths) and for left-shifted causal batches; the reference is not called."""

    def grads(fn, *inputs):
        ins = [t.clone().to(device).requires_grad_() for t in inputs]
        fn(*ins).pow(2).sum().backward()
        return [t.grad.cpu() for t in ins]

    q, k, v = (torch.randn(13, h, 8, generator=gen(60 + i)) for i, h in enumerate((4, 2, 2)))
    cu = torch.tensor([0, 4, 9, 13]).to(device)
    varlen = lambda q, k, v: K.varlen_attention(q, k, v, cu, 0.3)  # noqa: E731
    qb, kb, vb = (t[:12].reshape(2, 6, *t.shape[1:]) for t in (q, k, v))
    shifted = torch.stack([torch.arange(6), torch.arange(6) - 2]).to(device)  # the second row left-padded by 2
    shifted[1, :2] = 0
    causal = lambda q, k, v: K.causal_attention(q, k, v, shifted, 0.3)  # noqa: E731
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "reference")  # CUDA's default is fused
    expected = {"varlen": grads(varlen, q, k, v), "causal": grads(causal, qb, kb, vb)}
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "fused")
    monkeypatch.setattr(torch_reference, "_reference_gradients", lambda *a: pytest.fail("the reference ran"))
    with monkeypatch.context() as patch:  # whole sequences: no check of the positions (a GPU sync each, per layer)
        patch.setattr(torch, "equal", lambda *a: pytest.fail("varlen's positions were checked"))
        got = {"varlen": grads(varlen, q, k, v)}
    got["causal"] = grads(causal, qb, kb, vb)
    for case in expected:
        for name, a, b in zip("qkv", got[case], expected[case], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case} d{name}")
    # a query with no visible key (position -1): NaN forward row; its gradients carry NaN as the reference's do
    monkeypatch.undo()
    hidden = shifted.clone()
    hidden[1, 0] = -1
    hole = lambda q, k, v: K.causal_attention(q, k, v, hidden, 0.3)  # noqa: E731
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "reference")
    expected = grads(hole, qb, kb, vb)
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "fused")
    for name, a, b in zip("qkv", grads(hole, qb, kb, vb), expected, strict=True):
        assert b.isnan().any() or name != "v"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"no visible key, d{name}")
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "flash")
    with pytest.raises(ValueError, match="ALIGNAUDIT_BACKWARD='flash': use one of auto, reference, fused"):
        grads(varlen, q, k, v)


def test_the_backward_by_default_is_fused_on_cuda_and_the_reference_elsewhere(monkeypatch):
    """ALIGNAUDIT_BACKWARD unset (auto): fused for CUDA tensors, reference for the others; a value set is taken as
    it is on either; an unknown one is refused naming the values."""
    monkeypatch.delenv("ALIGNAUDIT_BACKWARD", raising=False)
    assert (gradients.backward_on(True), gradients.backward_on(False)) == ("fused", "reference")
    for value in ("reference", "fused"):
        monkeypatch.setenv("ALIGNAUDIT_BACKWARD", value)
        assert gradients.backward_on(True) == gradients.backward_on(False) == value
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "")
    with pytest.raises(ValueError, match="ALIGNAUDIT_BACKWARD='': use one of auto, reference, fused"):
        gradients.backward_on(True)


def test_deterministic_mode_is_set_for_the_backward_only_and_restored():
    """flash_gradients.deterministic_algorithms turns torch's deterministic mode on (FlashAttention-2's backward
    reads it) and its NaN fill of new memory off for the block, and restores the caller's three settings after,
    an exception included."""
    from alignaudit_kernels.attention.flash_gradients import deterministic_algorithms

    def settings():
        return (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
        )

    before = settings()
    try:
        for mode, warn_only in ((False, False), (True, True)):
            torch.use_deterministic_algorithms(mode, warn_only=warn_only)
            with deterministic_algorithms():
                assert settings() == (True, False, False)
            assert settings() == (mode, warn_only, True)
            with pytest.raises(RuntimeError, match="inside"), deterministic_algorithms():
                raise RuntimeError("inside")
            assert settings() == (mode, warn_only, True)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_mode_holds_while_blocks_of_two_threads_overlap():
    """Autograd runs a backward per device thread: while thread B's block is still inside after thread A's has left,
    the mode stays on, and once both have left the settings from before the first are back (a save per block
    would have turned the mode off under B and left it on for good)."""
    import threading

    from alignaudit_kernels.attention.flash_gradients import deterministic_algorithms

    def settings():
        return torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory

    before = settings()
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with deterministic_algorithms():
            a_inside.set()
            b_inside.wait(10)
        a_left.set()

    def b():
        a_inside.wait(10)
        with deterministic_algorithms():
            b_inside.set()
            a_left.wait(10)
            seen["inside B after A left"] = settings()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"inside B after A left": (True, False)}
    assert settings() == before


def test_fused_varlen_backward_is_flashattention2s_deterministic_and_close_to_the_reference(monkeypatch, device):
    """On CUDA in bf16, ALIGNAUDIT_BACKWARD=fused takes varlen_attention's gradients from one FlashAttention-2 varlen
    backward fed the strict forward's output and log-sum-exp (attention/flash_gradients.py): the same bits in three
    runs (its deterministic mode), no per-length regrouping (attention_gradients never called), and no further from
    the fp32 reference than the grouped SDPA path (GQA expanded) is, nor than the flash backward with its own
    recomputed forward."""
    if device != "cuda":
        pytest.skip("FlashAttention-2 is torch's CUDA kernel")
    from alignaudit_kernels.attention import flash_gradients, functions

    lengths, h, kvh, d = [1500, 700, 64, 333], 32, 8, 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    q, k, v = (randn(t, n, d, dtype=torch.bfloat16, device=device, seed=70 + i) for i, n in enumerate((h, kvh, kvh)))
    g = randn(t, h, d, dtype=torch.bfloat16, device=device, seed=73)

    def grads():
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        K.varlen_attention(*ins, cu, d**-0.5).backward(g)
        return [x.grad.float() for x in ins]

    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "reference")
    reference = grads()
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "fused")
    with monkeypatch.context() as patch:
        patch.setattr(functions, "flash_backward_available", lambda q: False)
        grouped = grads()  # the SDPA path, one batch per length
    calls = []
    real = functions.varlen_flash_gradients
    monkeypatch.setattr(functions, "varlen_flash_gradients", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(functions, "attention_gradients", lambda *a, **kw: pytest.fail("regrouped by length"))
    runs = [grads() for _ in range(3)]
    assert len(calls) == 3 and all(lse is not None and lse.shape == (h, t) for lse in calls)
    for run in runs[1:]:
        for name, a, b in zip("qkv", run, runs[0], strict=True):
            assert_bitwise_equal(f"d{name}, run to run", a, b)
    recomputed = flash_gradients.varlen_flash_gradients(q, k, v, g, cu, max(lengths), d**-0.5)
    for name, flash, other, again, ref in zip("qkv", runs[0], grouped, recomputed, reference, strict=True):
        error = ((flash - ref).norm() / ref.norm()).item()
        assert error < 2 * ((other - ref).norm() / ref.norm()).item() + 1e-4, f"d{name}: {error} vs the SDPA path"
        assert error < 2 * ((again.float() - ref).norm() / ref.norm()).item() + 1e-4, f"d{name}: {error} vs recomputed"
        assert error < 1e-2, f"d{name}: relative error {error}"


def test_entry_points_compute_the_same_bits_with_and_without_autograd(monkeypatch, device, dtype):
    """An entry point called where no gradient can be recorded skips its torch.autograd.Function
    (primitives.no_gradient; the Functions' apply is made to fail meanwhile): same output bits as the
    recording call, and nothing recorded."""
    x, w = randn(6, 64, dtype=dtype, device=device, seed=30), randn(32, 64, dtype=dtype, device=device, seed=31)
    t = torch.arange(6, device=device) % 32
    cos, sin = rope.rope_tables(64, 16, 1e4, device)
    q, k = randn(6, 4, 16, dtype=dtype, device=device, seed=32), randn(6, 2, 16, dtype=dtype, device=device, seed=33)
    cu = torch.tensor([0, 2, 6])
    calls = {
        "linear": (lambda a: K.linear(a, w), x),
        "linear, 4 segments": (lambda a: K.linear(a, w, k_segments=4), x),
        "rms_norm": (lambda a: K.rms_norm(a, w[0], 1e-6), x),
        "add_rms_norm": (lambda a: torch.cat(K.rms_norm(a, w[0], 1e-6, residual=x.flip(0)), -1), x),
        "apply_rope": (lambda a: K.apply_rope(a, t, cos, sin), q),
        "silu_mul": (lambda a: K.silu_mul(a, x.flip(1)), x),
        "log_softmax": (lambda a: K.log_softmax(a), x),
        "token_logprobs": (lambda a: K.token_logprobs(a, t), x),
        "varlen_attention": (lambda a: K.varlen_attention(a, k, k, cu, 0.25), q),
        "causal_attention": (lambda a: K.causal_attention(a, k, k, t, 0.25), q),
    }
    real_apply = torch.autograd.Function.apply.__func__

    def apply_only_when_recording(cls, *args, **kwargs):
        assert torch.is_grad_enabled(), f"{cls.__name__}.apply called where no gradient can be recorded"
        return real_apply(cls, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(apply_only_when_recording))
    for name, (fn, arg) in calls.items():
        with torch.no_grad():
            plain = fn(arg)
        recorded = fn(arg.detach().clone().requires_grad_())
        assert plain.grad_fn is None and recorded.grad_fn is not None, name
        assert_bitwise_equal(name, plain, recorded.detach())


def test_a_strict_layer_forward_and_backward_wait_for_nothing_after_the_first_step(monkeypatch, device):
    """A training step calls each strict op in every layer on the same layout (host cu_seqlens, positions on the
    device): after the first step (kernels built, launch plans and the device copy of the sequence bounds cached),
    a layer's forward and fused backward make no call that waits for the stream. torch.cuda.set_sync_debug_mode
    ("error") raises on one (a blocking host-to-device copy, a read of a device value); each such wait drains the
    launch queue and leaves the GPU idle while the host refills it (the strict update's gaps over 100 us). The
    control: a blocking copy of the bounds to the device is caught."""
    if device != "cuda":
        pytest.skip("waits for the stream exist on CUDA only")
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "fused")
    t, hidden, h, kvh, d = 300 + 64 + 129, 512, 8, 2, 64
    cu = torch.tensor([0, 300, 364, 493])
    positions = torch.cat([torch.arange(n) for n in (300, 64, 129)]).to(device)
    cos, sin = rope.rope_tables(1024, d, 1e6, device)
    x0 = randn(t, hidden, dtype=torch.bfloat16, device=device, seed=80)
    weights = [
        randn(*shape, dtype=torch.bfloat16, device=device, seed=81 + i) * 0.05
        for i, shape in enumerate(
            (
                (hidden,),
                ((h + 2 * kvh) * d, hidden),
                (d,),
                (hidden, h * d),
                (2 * 4 * hidden, hidden),
                (hidden, 4 * hidden),
                (1000, hidden),
            )
        )
    ]
    targets = torch.randint(0, 1000, (t,), generator=gen(88)).to(device)

    def step():
        x = x0.clone().requires_grad_()
        w_norm, w_qkv, w_head, w_o, w_up, w_down, w_vocab = (w.clone().requires_grad_() for w in weights)
        qkv = K.linear(K.rms_norm(x, w_norm, 1e-6), w_qkv)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = K.apply_rope(K.rms_norm(q.view(t, h, d), w_head, 1e-6), positions, cos, sin)
        k = K.apply_rope(K.rms_norm(k.view(t, kvh, d), w_head, 1e-6), positions, cos, sin)
        attended = K.varlen_attention(q, k, v.reshape(t, kvh, d), cu, d**-0.5).flatten(1)
        y, residual = K.rms_norm(K.linear(attended, w_o, None, 4), w_norm, 1e-6, residual=x)
        gate, up = K.linear(y, w_up).chunk(2, dim=-1)
        out = residual + K.linear(K.silu_mul(gate, up), w_down, None, 4)
        K.token_logprobs(K.linear(out, w_vocab), targets).sum().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        with pytest.raises(RuntimeError, match="synchroniz"):
            cu.to(device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
