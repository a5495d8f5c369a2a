"""The math primitives every strict kernel uses: exp, log, rsqrt, and a fixed-order sum.

One algorithm each, written twice with the same steps: in torch (the CPU backend) and as Triton device
functions (the GPU backend; exp_t drops two steps that change no result, its docstring says why). Only
IEEE-754 operations that are correctly rounded everywhere are used (+, -, *, /, sqrt, floor, comparisons,
exact bit manipulation), each rounding separately: no library
exp/log (glibc, Sleef and CUDA's differ in the last bit, and torch's CPU loops use Sleef for full vectors
but the scalar libm for the tail, so ``torch.exp`` can depend on an element's position in the tensor),
and no fused multiply-add (Triton kernels are compiled with ``enable_fp_fusion=False``).

exp (fp32): Cody-Waite range reduction x = n*ln2 + r with n = floor(x*log2(e) + 0.5), ln2 split into
    LN2_HI (exact in 16 bits, so n*LN2_HI is exact) and LN2_LO; e^r by the degree-7 Taylor polynomial in
    Horner form (truncation < 6e-9 relative on |r| <= ln2/2); scaled by 2^n as two exact power-of-two
    factors so that subnormal results round once. Measured error: <= 2 ULP (tests/kernels).
log (fp32): x = m * 2^e with m in [sqrt(1/2), sqrt(2)) by bit manipulation (subnormals pre-scaled by
    2^25); log(m) with s = f/(2+f), f = m-1, and the fdlibm e_logf.c polynomial in s^2; e*ln2 added as
    hi and lo parts. Measured error: <= 2 ULP.
rsqrt: 1 / sqrt(x): two correctly rounded operations (sqrt_rn corrects torch's CPU sqrt, which is not
    correctly rounded in fp32), so the CPU and GPU results are bit-identical.
unit_sum: sum of fp32 values in [0, 1] (or NaN) without rounding until the end: each term is truncated to a
    multiple of 1/S, S = 2^(62 - ceil(log2 n)) for n terms, the multiples are added as int64 (exact, so
    the sum is the same in every order, split, load width and thread layout), and the total rounds to
    fp32 once. Truncation error < n/S <= 2^(2 ceil(log2 n) - 62) absolute: < 2^-26 for the 151936 entries
    of the Qwen3 vocabulary, 1/8 ULP of a sum >= 1. Any NaN term makes the sum NaN. The CPU and Triton
    versions give the same bits. (Exact fixed-point accumulation as in Kulisch's long accumulator, cut to
    one int64 word because the terms are bounded.)
fixed_sum (CPU): pad the reduced axis with +0.0 to a multiple of BLOCK (32), sum each block by a pairwise
    tree (element i with i+16, then i+8, ...), then add the block sums left to right. The order depends
    only on the axis length, never on the other dimensions, the thread count or memory layout.
Sources: W. J. Cody and W. Waite, "Software Manual for the Elementary Functions" (1980); fdlibm
(e_expf.c, e_logf.c, Sun Microsystems 1993) for the reduction constants and the log polynomial.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

BLOCK = 32

LOG2E = 1.44269504088896341
LN2_HI = 0.693145751953125  # 0x3f317200: 16 significant bits, so n * LN2_HI is exact for |n| < 256
LN2_LO = 1.428606765330187e-06  # 0x35bfbe8e: ln2 - LN2_HI
EXP_HI = 88.72283935546875  # above: +inf
EXP_LO = -103.97207708  # below: 0
EXP_POLY = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)  # Horner, highest degree first
SQRT_HALF_BITS = 0x3F3504F3  # sqrt(1/2) in fp32
LG1, LG2, LG3, LG4 = 0.66666662693, 0.40000972152, 0.28498786688, 0.24279078841  # fdlibm e_logf.c


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2**n for integral float n in [-126, 127], exactly, from the exponent bits."""
    return ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x elementwise, fp32 in and out (module docstring: algorithm and error)."""
    x = x.float()
    n = torch.floor(x * LOG2E + 0.5)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    n = n.clamp(-252.0, 254.0)
    half = torch.floor(n * 0.5)
    y = (p * _pow2(half)) * _pow2(n - half)
    y = torch.where(x > EXP_HI, float("inf"), y)
    y = torch.where(x < EXP_LO, 0.0, y)
    return torch.where(torch.isnan(x), x, y)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log elementwise, fp32 in and out; log(0) = -inf, log(x<0) = NaN, log(inf) = inf."""
    x = x.float()
    tiny = x < 1.1754943508222875e-38  # subnormal (or zero/negative): pre-scale by 2**25
    xs = torch.where(tiny, x * 33554432.0, x)
    bits = xs.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(tiny, 25, 0).to(torch.int32)
    mant = (bits & 0x007FFFFF) | 0x3F800000  # m in [1, 2)
    big = mant > (SQRT_HALF_BITS + 0x00800000)  # m > sqrt(2): use m/2, e+1
    m = torch.where(big, mant - 0x00800000, mant).view(torch.float32)
    e = (e + big.to(torch.int32)).float()
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    r = z * (LG1 + w * (LG3)) + w * (LG2 + w * LG4)
    hfsq = 0.5 * f * f
    y = e * LN2_HI - ((hfsq - (s * (hfsq + r) + e * LN2_LO)) - f)
    y = torch.where(x == 0, float("-inf"), y)
    y = torch.where(x < 0, float("nan"), y)
    y = torch.where(torch.isinf(x) & (x > 0), x, y)
    return torch.where(torch.isnan(x), x, y)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root.

    torch.sqrt on the CPU is not correctly rounded for fp32 (its vectorized path is off by one ULP for
    some inputs). Starting from it, the result is moved to the neighbour whose rounding interval holds
    the true root; the midpoint tests are exact in float64 (a midpoint has 25 significant bits, its
    square 50), and a square root never falls exactly on a midpoint.
    """
    x = x.float()
    s = torch.sqrt(x)
    xd, sd = x.double(), s.double()
    up = torch.nextafter(s, torch.full_like(s, float("inf")))
    down = torch.nextafter(s, torch.zeros_like(s))
    mid_up = (sd + up.double()) * 0.5
    mid_down = (sd + down.double()) * 0.5
    s = torch.where(mid_up * mid_up < xd, up, s)
    return torch.where(mid_down * mid_down > xd, down, s)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x), fp32: correctly rounded sqrt, then correctly rounded division."""
    return 1.0 / sqrt_rn(x)


def fixed_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` in the fixed order of the module docstring (fp32 in, fp32 out)."""
    x = x.float().movedim(dim, -1)
    n = x.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    blocks = block_sums(x.unflatten(-1, (-1, BLOCK)))
    total = blocks[..., 0]
    for b in range(1, blocks.shape[-1]):
        total = total + blocks[..., b]
    return total


UNIT_SUM_MAX_TERMS = 1 << 20  # beyond it the truncation error could exceed 2**-22 (2 ULP of a sum >= 1)


def unit_sum_scale(n: int) -> float:
    """S = 2**(62 - ceil(log2 n)) of ``unit_sum`` for n terms: n terms below S each sum below 2**62.
    Raises ValueError for n > UNIT_SUM_MAX_TERMS."""
    if n > UNIT_SUM_MAX_TERMS:
        raise ValueError(f"unit_sum: {n} terms; at most {UNIT_SUM_MAX_TERMS} keep the truncation error under 2**-22")
    return float(2 ** (62 - max(0, (n - 1).bit_length())))


def unit_sum(x: torch.Tensor) -> torch.Tensor:
    """Exact fixed-point sum over the last axis of fp32 values in [0, 1] (module docstring): [..., n] -> [...],
    fp32. A NaN anywhere in a row makes that row's sum NaN."""
    scale = unit_sum_scale(x.shape[-1])
    return units_to_sum(*unit_sum_units(x, scale), scale)


def unit_sum_units(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer half of ``unit_sum`` over the last axis: (sum of trunc(x * scale) [...] int64, rows holding a
    NaN [...] int64 0/1). Partial results of any split of the axis add (and max) to the whole axis's, exactly."""
    x = x.float()
    nan = torch.isnan(x)
    return (torch.where(nan, 0.0, x) * scale).to(torch.int64).sum(-1), nan.any(-1).to(torch.int64)


def units_to_sum(units: torch.Tensor, nan: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 sum from ``unit_sum_units``' results: units / scale, rounded once; NaN where a NaN was seen."""
    return torch.where(nan != 0, float("nan"), units.to(torch.float32) * (1.0 / scale))


def block_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., BLOCK] -> [...]: the pairwise tree of one block (i + i+16, then i + i+8, ...)."""
    width = x.shape[-1]
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install without Triton: the CPU backend still works
    triton = None


def rocm() -> bool:
    """True on a ROCm build of torch (AMD GPUs, which torch names "cuda" devices): launch planning only."""
    return torch.version.hip is not None


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable ``name``, one of ``choices`` (the first when it is unset).

    Raises:
        ValueError: any other value (an empty one included), naming the variable and the choices.
    """
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)}")
    return value


def use_triton(x: torch.Tensor) -> bool:
    """The Triton backend for CUDA tensors, and for CPU tensors under TRITON_INTERPRET=1 (the tests'
    interpreter runs); the CPU backend otherwise."""
    return x.is_cuda or (triton is not None and os.environ.get("TRITON_INTERPRET") == "1")


def compiling_inference(*tensors: torch.Tensor | None) -> bool:
    """True while torch.compile traces a call that needs no gradient. The strict kernels that model forwards
    call (linear, rms_norm, silu_mul, apply_rope(_qk), causal_attention, log_softmax, token_logprobs) then enter
    the graph as opaque custom ops (``opaque_op``): Dynamo does not trace their Triton launch code or
    host-side planning, and they compute what they compute eagerly, bit for bit. Calls that need gradients
    keep the autograd path (the compiled strict path is forward only); varlen_attention, paged_attention and
    paged_decode are not wrapped (a graph break where a compiled model calls them)."""
    return torch.compiler.is_compiling() and no_gradient(*tensors)


def no_gradient(*tensors: torch.Tensor | None) -> bool:
    """True when a call can record no gradient (grad mode off, or no input requires one). Eager kernel entry
    points then call their forward directly, skipping torch.autograd.Function (about a quarter of a strict
    linear's host wrapper time, measured with the launch stubbed out); the arithmetic is the same."""
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


_LIBRARIES: dict[str, torch.library.Library] = {}  # namespace -> its library; an op lives as long as its library


def opaque_op(name: str, schema: str, fake, namespace: str = "alignaudit_kernels"):
    """Register the decorated forward function as the custom op ``<namespace>::<name>`` with the given schema
    and ``fake`` for shape propagation; returns the op (``torch.ops.<namespace>.<name>.default``). The
    function must return fresh tensors (no views of its inputs): nothing checks it at run time.

    Registered by ``torch.library.Library.define`` and ``impl`` under CompositeExplicitAutograd (every
    device), not ``torch.library.custom_op``: that wrapper adds Python dispatch around each call (an
    aliasing check, its autograd layer): 1.9-5.1 us more a call under torch.inference_mode, as vLLM runs
    its forward, and 8.6-14.2 us more under torch.no_grad (bench/wrapper_overhead.py side by side, six runs on a 2-core
    Intel Xeon, torch 2.13 CPU, 2026-12-05). vLLM registers its own ops this way for the same reason
    (``direct_register_custom_op`` in vllm/utils/torch_utils.py). No autograd kernel: the strict kernels call
    their op only where no gradient is recorded (``compiling_inference``), and a call that would record one
    raises RuntimeError (without it, autograd's fallback would hand back an output whose backward only warns);
    tests/kernels/test_compile.py checks that no op returns an input, the check custom_op made at run time.
    https://pytorch.org/docs/stable/library.html
    """
    library = _LIBRARIES.get(namespace)
    if library is None:
        library = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")

    def register(fn):
        @functools.wraps(fn)
        def forward_only(*args):
            if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                raise RuntimeError(
                    f"{namespace}::{name} is forward only: call it without gradients (torch.no_grad) "
                    f"or call its kernel function, which has a backward"
                )
            return fn(*args)

        library.define(f"{name}{schema}", tags=(torch.Tag.pt2_compliant_tag,))
        library.impl(name, forward_only, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{name}", fake, lib=library)
        op = getattr(getattr(torch.ops, namespace), name).default
        OPAQUE_OPS.append(op)
        return op

    return register


OPAQUE_OPS: list = []  # every op opaque_op registered, in registration order (tests/kernels/test_compile.py)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids on the host: plain integer arithmetic (triton.cdiv is a JIT function,
    whose Python call unwraps constexprs: about a fifth of the strict linear's host wrapper time, measured
    with the launch stubbed out)."""
    return -(-a // b)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as rows [N, H]: x itself where it is 2-D already (a view otherwise, or a copy where reshape needs
    one). Why not always ``reshape``: even when it changes nothing it costs the host a view's construction, 0.4-0.8 us
    a call on a 2-core Intel Xeon (torch 2.13 CPU, 2026-12-06), paid by every strict op of every layer."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def as_shape(y: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """y reshaped to ``shape``: y itself where it has that shape already (a reshape to a torch.Size costs the
    host 1.2-1.7 us a call on the machine of ``as_rows``, even when it changes nothing)."""
    return y if y.shape == shape else y.reshape(shape)


def as_dtype(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y cast to ``dtype``, with no cast where it has that dtype: torch 2.11's compiled ``autograd.Function`` gave a
    forward ending in a no-op ``.to`` an all-zero gradient (rope on 2026-12-04, linear on 2026-12-06: fp32 CPU paths,
    tests/kernels/test_compile.py; torch 2.13 does not)."""
    return y if y.dtype == dtype else y.to(dtype)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for block sizes chosen on the host: plain integer arithmetic, as
    ``cdiv``. triton.next_power_of_2 gives the same values but is a constexpr function since Triton 3.5, whose
    Python call unwraps its arguments: 2.4 us a call against 0.035 on a 2-core Intel Xeon (2026-12-05)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()


def row_warps(block: int) -> int:
    """The warps of a program that holds one row of ``block`` elements (a power of two): one per 256 elements, 1 to
    16. It fixes how many of a row's elements a thread holds, and so tl.sum's tree over the row: RMSNorm's kernels
    (forward, the multi-row candidate, the fused gradient) share it."""
    return min(16, max(1, block // 256))


def cached_tensors(maxsize: int):
    """``functools.lru_cache`` for functions that build tensors kept for the life of the process (rope tables,
    launch plans), which build them outside ``torch.inference_mode``.

    Why: a tensor made inside inference mode is an inference tensor for good; one engine's first call inside
    ``torch.inference_mode`` (vLLM runs its forward there) would hand every later caller, a trainer in the same
    process included, tensors that autograd refuses to save for backward ("Inference tensors cannot be saved
    for backward"). Built outside it, the same tensors serve both, with the same values.
    """

    def wrap(build):
        @functools.lru_cache(maxsize=maxsize)
        @functools.wraps(build)
        def cached(*args, **kwargs):
            with torch.inference_mode(False):
                return build(*args, **kwargs)

        return cached

    return wrap


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor ``x`` on ``device``, copied without the host waiting for it: from pinned memory to a CUDA device
    (a copy from pageable memory may wait for the stream; torch's caching host allocator keeps the pinned copy until
    the transfer is done), as it is elsewhere."""
    if torch.device(device).type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


@contextlib.contextmanager
def descriptor_scratch(needed: bool, device: torch.device):
    """Device-side tensor descriptors (``tl.make_tensor_descriptor``) need 128 bytes of global memory per descriptor
    and program at launch; Triton's launcher takes it from the allocator in its context variable
    (triton.runtime._allocation, which triton.set_allocator sets). Set a torch one for the launches inside this
    block only, so that the caller's setting (vLLM's, a user's) is untouched."""
    if not needed:
        yield
        return
    from triton.runtime import _allocation

    token = _allocation._allocator.set(
        lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)
    )
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (launch planning only)."""
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (launch planning only, never the arithmetic)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def reduction_input(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as a contiguous tensor of ``dtype`` (default its own) starting on a 16-byte boundary: x itself
    where it is one already, else a fresh copy.

    Why: a Triton kernel that loads a row and reduces it with tl.sum adds the elements in an order set by
    the register layout, and the compiler sets that layout from the width of the vector loads, which
    depends on the element size and on the alignment Triton specializes the pointer on (data_ptr % 16).
    On an H200 (Triton 3.6) the same fp32 values summed from a bf16 buffer and from an fp32 buffer gave
    other bits. Kernels that reduce floats with tl.sum (RMSNorm) take their inputs through here, so one row
    length gives one order whatever buffer the caller holds (the logprob kernels sum exactly: unit_sum).
    """
    dtype = dtype or x.dtype
    if x.dtype == dtype and x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    return out.copy_(x)


if triton is not None:

    @triton.jit
    def pow2_t(n):
        return ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def exp_t(x):
        """Triton twin of ``exp``: the same rounded operations for every result that reaches the output
        (compile with enable_fp_fusion=False), in four fewer instructions on sm_90 (SASS of a one-element-a-
        thread kernel: 37 -> 33 arithmetic instructions an element; FRND and F2I, the slow conversions, once
        each instead of twice; tests/kernels/cross_compile.py builds it): ``exp`` clamps n to [-252, 254], which
        changes no result the range checks keep (x in [EXP_LO, EXP_HI] gives n in [-150, 128]; outside, the
        checks replace y), and floor(n * 0.5) of an integral n is its arithmetic shift right by one. Equal to
        ``exp`` bit for bit on all 2^32 fp32 inputs (under the Triton interpreter, 2026-12-05; its overflow check
        has since moved out of exp_t_up_to_overflow: the three checks act on disjoint inputs, so their order
        changes nothing)."""
        return tl.where(x > 88.72283935546875, float("inf"), exp_t_up_to_overflow(x))

    @triton.jit
    def exp_t_up_to_overflow(x):
        """``exp_t`` without its overflow check: the same bits for every x <= EXP_HI and NaN (the check replaces
        nothing there), two instructions fewer. For softmax's differences from a running maximum, which are
        <= 0 or NaN (attention's scores and rescaling factors); any x > EXP_HI gives garbage."""
        n = tl.floor(x * 1.44269504088896341 + 0.5)
        r = (x - n * 0.693145751953125) - n * 1.428606765330187e-06
        p = r * (1.0 / 5040) + (1.0 / 720)
        p = p * r + (1.0 / 120)
        p = p * r + (1.0 / 24)
        p = p * r + (1.0 / 6)
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        whole = n.to(tl.int32)  # outside [EXP_LO, EXP_HI] (and NaN) any value: the checks replace y
        half = whole >> 1
        y = (p * pow2_t(half)) * pow2_t(whole - half)
        y = tl.where(x < -103.97207708, 0.0, y)
        return tl.where(x != x, x, y)

    @triton.jit
    def log_t(x):
        """Triton twin of ``log``."""
        tiny = x < 1.1754943508222875e-38
        xs = tl.where(tiny, x * 33554432.0, x)
        bits = xs.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 25, 0)
        mant = (bits & 0x007FFFFF) | 0x3F800000
        big = mant > (0x3F3504F3 + 0x00800000)
        m = tl.where(big, mant - 0x00800000, mant).to(tl.float32, bitcast=True)
        ef = (e + big.to(tl.int32)).to(tl.float32)
        f = m - 1.0
        s = tl.div_rn(f, f + 2.0)
        z = s * s
        w = z * z
        r = z * (0.66666662693 + w * 0.28498786688) + w * (0.40000972152 + w * 0.24279078841)
        hfsq = 0.5 * f * f
        y = ef * 0.693145751953125 - ((hfsq - (s * (hfsq + r) + ef * 1.428606765330187e-06)) - f)
        y = tl.where(x == 0, float("-inf"), y)
        y = tl.where(x < 0, float("nan"), y)
        y = tl.where(x == float("inf"), x, y)
        return tl.where(x != x, x, y)

    @triton.jit
    def rsqrt_t(x):
        """Triton twin of ``rsqrt``: IEEE sqrt and division (tl.sqrt and tl.rsqrt are approximate)."""
        return tl.div_rn(1.0, tl.sqrt_rn(x))
