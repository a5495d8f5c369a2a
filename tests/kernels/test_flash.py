"""The flash attention kernel (alignaudit_kernels.attention.flash: FlashAttention-3 at one key split).

On the CPU: every entry point refuses it with the reason. On a Hopper GPU with vLLM's FA3 (bench/gpu_run.sh tests):
a row gets the same bits from a trainer's unpaged varlen prefill, a paged prefill, a decode step (alone and in a
batch of other lengths), a chunked prefill and a cached forward, and the backward is deterministic and matches
torch's attention gradients.
"""

from __future__ import annotations

import pytest
import torch

import alignaudit_kernels as K
from alignaudit_kernels.attention import flash_paged, flash_unavailable

H, KVH, D, PAGE = 8, 2, 128, 16


def test_flash_is_refused_on_the_cpu_by_every_entry_point():
    q = torch.randn(6, H, D, dtype=torch.bfloat16)
    k = v = torch.randn(6, KVH, D, dtype=torch.bfloat16)
    reason = flash_unavailable("cpu", torch.bfloat16, D)
    assert reason is not None and "CUDA (Hopper)" in reason
    if not torch.cuda.is_available():  # a reason, not torch's assertion, for a CUDA device this torch cannot see
        assert "sees no CUDA GPU" in flash_unavailable("cuda", torch.bfloat16, D)
    with pytest.raises(ValueError, match="CUDA \\(Hopper\\)"):
        K.varlen_attention(q, k, v, torch.tensor([0, 6]), 0.1, kernel="flash")
    with pytest.raises(ValueError, match="CUDA \\(Hopper\\)"):
        K.causal_attention(q, k, v, torch.arange(6), 0.1, kernel="flash")
    with pytest.raises(ValueError, match="CUDA \\(Hopper\\)"):
        flash_paged(
            q,
            k[None],
            v[None],
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 6]),
            torch.tensor([6]),
            6,
            6,
            0.1,
        )
    with pytest.raises(ValueError, match="must be one of portable, flash, not 'fa2'"):
        K.varlen_attention(q, k, v, torch.tensor([0, 6]), 0.1, kernel="fa2")


def _flash_ready() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return flash_unavailable("cuda", torch.bfloat16, D)


gpu = pytest.mark.skipif(_flash_ready() is not None, reason=str(_flash_ready()))


def _paged(k, v, generator):
    """k/v [L, KVH, D] in a paged cache with shuffled pages: (k_cache, v_cache, block_table [1, pages])."""
    pages = -(-k.shape[0] // PAGE)
    order = torch.randperm(pages, generator=generator).cuda()
    kc = torch.zeros(pages, PAGE, KVH, D, dtype=k.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    padded = torch.zeros(pages * PAGE, KVH, D, dtype=k.dtype, device="cuda")
    padded[: k.shape[0]] = k
    kc[order] = padded.view(pages, PAGE, KVH, D)
    padded[: v.shape[0]] = v
    vc[order] = padded.view(pages, PAGE, KVH, D)
    return kc, vc, order.int()[None]


@gpu
def test_flash_gives_a_row_the_same_bits_in_every_layout():
    g = torch.Generator().manual_seed(0)
    n = 700  # past several FA3 key tiles (128 and 176 wide)
    q = torch.randn(n, H, D, generator=g, dtype=torch.bfloat16).cuda()
    k = torch.randn(n, KVH, D, generator=g, dtype=torch.bfloat16).cuda()
    v = torch.randn(n, KVH, D, generator=g, dtype=torch.bfloat16).cuda()
    scale = D**-0.5
    reference = K.varlen_attention(q, k, v, torch.tensor([0, n]), scale, kernel="flash")  # a trainer's forward
    kc, vc, table = _paged(k, v, g)
    i32 = dict(dtype=torch.int32, device="cuda")
    prefill = flash_paged(q, kc, vc, table, torch.tensor([0, n], **i32), torch.tensor([n], **i32), n, n, scale)
    assert torch.equal(prefill, reference)
    chunk = flash_paged(
        q[400:], kc, vc, table, torch.tensor([0, n - 400], **i32), torch.tensor([n], **i32), n - 400, n, scale
    )
    assert torch.equal(chunk, reference[400:])
    for p in (0, 127, 128, 175, 176, 511, n - 1):  # a decode step at position p, alone and among other lengths
        alone = flash_paged(
            q[p : p + 1], kc, vc, table, torch.tensor([0, 1], **i32), torch.tensor([p + 1], **i32), 1, 4096, scale
        )
        assert torch.equal(alone, reference[p : p + 1]), p
        lengths = [p + 1, 3, 650, 64]
        batch = flash_paged(
            torch.cat([q[p : p + 1], q[:3][-1:], q[649:650], q[63:64]]),
            kc,
            vc,
            table.repeat(4, 1),
            torch.arange(5, **i32),
            torch.tensor(lengths, **i32),
            1,
            4096,
            scale,
        )
        assert torch.equal(batch[0], reference[p]), p
    cached = K.causal_attention(
        q[None, 600:], k[None], v[None], torch.arange(600, n, device="cuda")[None], scale, kernel="flash"
    )
    assert torch.equal(cached[0], reference[600:])
    with pytest.raises(ValueError, match="bottom-right"):
        K.causal_attention(
            q[None, :10], k[None, :20], v[None, :20], torch.arange(10, device="cuda")[None], scale, kernel="flash"
        )


@gpu
def test_flash_backward_is_deterministic_and_matches_torch():
    g = torch.Generator().manual_seed(1)
    lengths = [300, 77, 512]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    t = int(cu[-1])
    q0 = torch.randn(t, H, D, generator=g, dtype=torch.bfloat16).cuda()
    k0 = torch.randn(t, KVH, D, generator=g, dtype=torch.bfloat16).cuda()
    v0 = torch.randn(t, KVH, D, generator=g, dtype=torch.bfloat16).cuda()
    dout = torch.randn(t, H, D, generator=g, dtype=torch.bfloat16).cuda()

    def grads():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = K.varlen_attention(q, k, v, cu, D**-0.5, kernel="flash")
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    a, b = 300, 377  # one sequence against torch's SDPA in fp32
    q, k, v = (x[a:b].float().transpose(0, 1).requires_grad_() for x in (q0, k0, v0))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // KVH, 0), v.repeat_interleave(H // KVH, 0), is_causal=True
    )
    ref.backward(dout[a:b].float().transpose(0, 1))
    torch.testing.assert_close(first[0][a:b].float(), ref.detach().transpose(0, 1), atol=2e-2, rtol=2e-2)
    for got, want in zip(first[1:], (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got[a:b].float(), want.transpose(0, 1), atol=5e-2, rtol=5e-2)
