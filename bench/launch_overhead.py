"""Host time per call of each strict op against its default, at decode or prefill shapes, side by side in one run.

    python3 bench/launch_overhead.py [--device cuda] [--calls 200] [--tokens 1]

Host time: the wall time of ``calls`` back-to-back calls, before synchronizing, over ``calls``; at these
shapes the GPU finishes each kernel sooner than the host launches the next, so this is the Python, autograd
and launcher cost of one call (what an eager decode step pays per op, and what CUDA graphs remove). The
GPU time of the same call as a CUDA-graph replay is printed beside it. "kernel launch only" calls the strict
linear's launcher directly (no argument checks, no autograd.Function): the rest of its host time is Triton's.
Qwen3-8B shapes, one token (M = 1), or ``--tokens`` T rows (an eager prefill step, as vLLM runs one beyond its
CUDA-graph sizes: 2048 at the RL rollout shape of 32 x 64-token prompts). Above one token the host time holds while
the launch queue has room (calls well under a thousand launches), and the prefill's paged attention is added: the
strict one planning its query tiles in the call, and reading tiles planned once (as every layer after a step's
first does in vLLM); its default is torch's SDPA over the rows as one causal sequence, a host-time anchor only
(about 32 times the work of 32 sequences: its graph column does not compare). The strict call that plans its own
tiles is not capturable and has no graph column. On the CPU (--device cpu) both columns are the whole call and only
show that the script runs. The row "rope q+k: 2 strict calls | 1" compares two strict apply_rope calls (its
default column) with apply_rope_qk's one launch, what vLLM's strict rope calls since 7930b81; above 16 rows on
Hopper, "linear TMA launch: host | device descriptors" the TMA product with its tensor descriptors made on the host
(its default column) and on the device (matmul.TMA_DESCRIPTORS), host time and graph replays (the whole kernel's
GPU time; their difference estimates the device's descriptor work).
On CUDA the last rows split one strict RMSNorm call's host time into alignaudit's wrapper, Triton's Python
launch path (JITFunction.run) and its C launcher (CompiledKernel.run): ``launch_paths``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alignaudit_kernels as K  # noqa: E402


def host_us(fn, calls: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_us(fn, device: str) -> float | None:
    if device != "cuda":
        return None
    from bench.timing import graph_ms

    return graph_ms(fn, rep=50) * 1e3


def pairs(device: str, tokens: int = 1) -> dict:
    dt = torch.bfloat16
    x = torch.randn(tokens, 4096, dtype=dt, device=device)
    w = torch.randn(6144, 4096, dtype=dt, device=device) * 0.02
    nw = torch.randn(4096, dtype=dt, device=device)
    q = torch.randn(tokens, 32, 128, dtype=dt, device=device)
    kh = torch.randn(tokens, 8, 128, dtype=dt, device=device)
    pos = torch.zeros(tokens, dtype=torch.long, device=device)
    cos, sin = K.rope_tables(4096, 128, 1e6, device)
    gate, up = (torch.randn(tokens, 12288, dtype=dt, device=device) for _ in range(2))
    logits = torch.randn(1, 151936, dtype=dt, device=device)  # one row: a sampler's per step
    target = torch.zeros(1, dtype=torch.long, device=device)
    ctx = 4096
    kc = torch.randn(ctx // 16, 16, 8, 128, dtype=dt, device=device)
    table = torch.arange(ctx // 16, dtype=torch.int32, device=device)[None]
    lens = torch.full((1,), ctx, dtype=torch.int32, device=device)
    kd = kc.view(1, ctx, 8, 128).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_rope():
        c, s = cos[pos][:, None].to(dt), sin[pos][:, None].to(dt)
        return torch.cat([q[..., :64] * c - q[..., 64:] * s, q[..., 64:] * c + q[..., :64] * s], -1)

    ops = {
        "linear 4096x6144": (lambda: torch.nn.functional.linear(x, w), lambda: K.linear(x, w)),
        "linear 4096x6144, kernel launch only": (
            lambda: torch.nn.functional.linear(x, w),
            lambda: K.matmul.launch._triton(x, w, None) if K.primitives.use_triton(x) else K.linear(x, w),
        ),
        "linear 4096x4096, 4 K segments": (
            lambda: torch.nn.functional.linear(x, w[:4096]),
            lambda: K.linear(x, w[:4096], k_segments=K.matmul.ROW_PARALLEL_SEGMENTS),
        ),
        "rmsnorm 4096": (lambda: torch.nn.functional.rms_norm(x, (4096,), nw, 1e-6), lambda: K.rms_norm(x, nw, 1e-6)),
        "rope 32x128": (torch_rope, lambda: K.apply_rope(q, pos, cos, sin)),
        # not a default: the two strict calls vLLM's rope made before alignaudit::rope_qk, against the one now
        "rope q+k: 2 strict calls | 1": (
            lambda: (K.apply_rope(q, pos, cos, sin), K.apply_rope(kh, pos, cos, sin)),
            lambda: K.apply_rope_qk(q, kh, pos, cos, sin),
        ),
        "silu_mul 12288": (lambda: torch.nn.functional.silu(gate) * up, lambda: K.silu_mul(gate, up)),
        "token_logprobs 151936": (
            lambda: torch.log_softmax(logits.float(), -1).gather(1, target[:, None]),
            lambda: K.token_logprobs(logits, target),
        ),
    }
    if tokens > K.matmul.launch.TINY_M and device == "cuda" and K.matmul.launch._tma_available(x, w, None):
        # not a default yet: the TMA product's launch with its descriptors made on the host (its default column)
        # against made by each program on the device (matmul.TMA_DESCRIPTORS)
        tile, persistent = K.matmul.launch.TMA_PLANS["large" if tokens > K.matmul.launch.SMALL_M else "small", False]
        ops["linear TMA launch: host | device descriptors"] = (
            lambda: K.matmul.launch._triton_tma(x, w, tile, persistent, descriptors="host"),
            lambda: K.matmul.launch._triton_tma(x, w, tile, persistent, descriptors="device"),
        )
    if tokens == 1:
        ops["decode attention ctx 4096"] = (
            lambda: sdpa(q.transpose(0, 1)[None], kd, kd, enable_gqa=True),
            lambda: K.paged_decode(q, kc, kc, table, lens, 128**-0.5, ctx),
        )
        return ops
    # a prefill of 32 sequences sharing the rows (vLLM's paged call over one step's requests), keys in pages of 16
    per = -(-tokens // 32)
    q_seq = torch.arange(tokens) // per
    positions = (torch.arange(tokens) % per).to(device=device, dtype=torch.int32)
    pages = torch.arange(32 * -(-per // 16), dtype=torch.int32, device=device).view(32, -1)
    cache = torch.randn(pages.numel(), 16, 8, 128, dtype=dt, device=device)
    k = cache.flatten(0, 1)[:tokens]
    tiles = K.attention.paged_tiles(q_seq, 4, torch.device(device))

    def varlen():  # the default's host side of one attention call: torch's SDPA over the rows as ONE sequence
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], k.transpose(0, 1)[None], is_causal=True, enable_gqa=True
        )

    def paged(**kw):
        return K.paged_attention(q, cache, cache, pages, positions, q_seq, 128**-0.5, max_keys=per, **kw)

    paged.capturable = False  # it plans its tiles on the host: no graph column
    ops[f"prefill attention {tokens} rows"] = (varlen, paged)
    ops[f"prefill attention {tokens} rows, tiles planned once"] = (varlen, lambda: paged(tiles=tiles))
    return ops


def launch_paths(device: str) -> dict:
    """One strict RMSNorm call (4096 columns, one row) down four paths, host time only: the whole strict op
    (K.rms_norm), Triton's ``JITFunction.run`` alone (``kernel[grid](...)``: its binder, specialization key,
    cache lookup and checks), Triton's binder (the arguments' specialization) and the C launcher, and the
    compiled kernel's C launcher alone (``CompiledKernel.run``, what the JITFunction call ends in). The
    differences are alignaudit's wrapper, the part of Triton's Python launch path a lean launcher keeping its
    specialization could skip, and the binder; the last is the floor of any launch. CUDA only (a no-op on the
    CPU)."""
    if device != "cuda":
        return {}
    from alignaudit_kernels import primitives, rmsnorm

    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)
    w, y = torch.randn(4096, dtype=x.dtype, device=device), torch.empty_like(x)
    params = dict(
        x_ptr=x,
        r_ptr=x,
        w_ptr=w,
        y_ptr=y,
        s_ptr=x,
        H=4096,
        eps=1e-6,
        heads=1,
        stride_x=4096,
        stride_xh=0,
        stride_r=0,
        stride_y=4096,
        stride_s=4096,
        HAS_RESIDUAL=False,
        BLOCK_H=4096,
    )
    options = dict(num_warps=primitives.row_warps(4096), enable_fp_fusion=False)
    kernel = rmsnorm._rmsnorm_kernel
    compiled = kernel[(1,)](**params, **options)
    values = [params[name] for name in kernel.arg_names]  # every parameter in order, constexprs too, as run() passes
    stream = torch.cuda.current_stream().cuda_stream

    def launcher():
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    binder = kernel.device_caches[torch.cuda.current_device()][-1]

    def lean():  # what a launch path keeping Triton's specialization (its binder) but not the rest of run() costs
        bound = binder(**params, **options)[0]
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound.values())

    launcher()  # Triton's launcher internals differ between versions: fail here, inside main's try
    lean()
    return {
        "rmsnorm 4096: the strict op": lambda: K.rms_norm(x, w, 1e-6),
        "rmsnorm 4096: JITFunction.run": lambda: kernel[(1,)](**params, **options),
        "rmsnorm 4096: binder + CompiledKernel.run": lean,
        "rmsnorm 4096: CompiledKernel.run": launcher,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1, help="rows of each call (1: a decode step)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"{'op':28s} {'default host us':>16s} {'strict host us':>15s} {'strict/default':>15s} "
        f"{'default graph us':>17s} {'strict graph us':>16s}"
    )
    for name, (default, strict) in pairs(args.device, args.tokens).items():
        d, s = host_us(default, args.calls, args.device), host_us(strict, args.calls, args.device)
        gd = graph_us(default, args.device)
        capturable = getattr(strict, "capturable", True)
        gs = graph_us(strict, args.device) if capturable else (None if gd is None else float("nan"))
        graphs = f"{gd:17.1f} {gs:16.1f}" if gd is not None else ""
        print(f"{name:28s} {d:16.1f} {s:15.1f} {s / d:15.2f} {graphs}", flush=True)
    try:
        paths = launch_paths(args.device)
    except Exception as e:  # noqa: BLE001 - Triton's launcher internals differ between versions: say so, go on
        print(f"launch paths: {type(e).__name__}: {str(e)[:200]}")
        paths = {}
    for name, fn in paths.items():
        print(f"{name:36s} host {host_us(fn, args.calls, args.device):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
