"""Strict kernels, the fused gradients (kernels/alignaudit_kernels/gradients.py, ALIGNAUDIT_BACKWARD=fused): the
Triton kernels of the elementwise ops against the reference backward. Named without "backward": the interpreter run
(test_kernels_interpret.py) deselects that word, and these kernels are what it must run.

The backend is --kernel-device's (tests/kernels/conftest.py): the Triton backend only (the CPU backend keeps the
reference for these ops).
"""

from __future__ import annotations

import pytest
import torch

import alignaudit_kernels as K
from alignaudit_kernels import gradients, rmsnorm, rope, silu
from helpers import INTERPRET, gen, randn

pytestmark = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()),
    reason="the fused gradients are Triton kernels; the CPU backend keeps the reference",
)

TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def gradients_of(fn, inputs, seed):
    ins = [t.clone().requires_grad_() for t in inputs]
    out = fn(*ins)
    out = torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out
    out.backward(torch.randn(out.shape, generator=gen(seed)).to(out))
    return [t.grad for t in ins]


def test_fused_gradients_equal_the_reference_to_rounding(device, dtype, monkeypatch):
    """RMSNorm (alone and with a residual; 70 rows, more than two blocks of GRAD_ROWS, H 96 not a power of two),
    SiLU-mul (and silu_and_mul's strided halves) and rope: the fused kernels' gradients equal the reference's to
    the dtype's rounding, and the references' autograd does not run (made to fail) once fused is asked."""
    tables = rope.rope_tables(64, 16, 1e4, device)
    positions = torch.tensor([0, 5, 63, 17, 2, 40, 9, 33, 1]).to(device)

    def r(*shape, seed, scale=1.0):
        return randn(*shape, dtype=dtype, device=device, seed=seed, scale=scale)

    cases = {
        "rms_norm": (lambda x, w: K.rms_norm(x, w, 1e-6), [r(70, 96, seed=1), r(96, seed=2)]),
        "add_rms_norm": (
            lambda x, res, w: K.rms_norm(x, w, 1e-6, residual=res),
            [r(70, 96, seed=3), r(70, 96, seed=4), r(96, seed=5)],
        ),
        "silu_mul": (K.silu_mul, [r(5, 7, 48, seed=6, scale=3.0), r(5, 7, 48, seed=7)]),
        "silu_and_mul": (K.silu_and_mul, [r(11, 96, seed=8, scale=3.0)]),
        "rope": (lambda x: K.apply_rope(x, positions, *tables), [r(9, 6, 16, seed=9)]),
    }
    monkeypatch.setenv(gradients.BACKWARD_ENV, "reference")  # CUDA's default is fused
    expected = {name: gradients_of(fn, ins, seed=20) for name, (fn, ins) in cases.items()}
    monkeypatch.setenv(gradients.BACKWARD_ENV, "fused")
    for module in (rmsnorm, silu, rope):
        monkeypatch.setattr(module, "reference", lambda *a, **k: pytest.fail("a reference's autograd ran"))
    rtol, atol = TOLERANCE[dtype]
    for name, (fn, ins) in cases.items():
        for i, (a, b) in enumerate(zip(gradients_of(fn, ins, seed=20), expected[name], strict=True)):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol * float(b.abs().max()), msg=f"{name} input {i}")


def test_fused_rope_gradient_is_nan_outside_the_tables(device, monkeypatch):
    """A position past the tables gives a NaN forward row on the Triton backend, and its gradient row is NaN too,
    as in the reference backward; the other rows stay finite."""
    monkeypatch.setenv(gradients.BACKWARD_ENV, "fused")
    cos, sin = rope.rope_tables(8, 16, 1e4, device)
    positions = torch.tensor([0, cos.shape[0], 3]).to(device)
    (grad,) = gradients_of(
        lambda x: K.apply_rope(x, positions, cos, sin).nan_to_num(0.0),
        [randn(3, 2, 16, dtype=torch.float32, device=device, seed=30)],
        seed=31,
    )
    assert bool(grad[1].isnan().all()) and bool(grad[[0, 2]].isfinite().all())
