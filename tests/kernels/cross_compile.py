"""Compile every strict Triton kernel for a GPU this machine does not have, in the launch configurations the
host wrappers choose, without running any of them.

    python tests/kernels/cross_compile.py sm90 [--all]      # NVIDIA Hopper (H100/H200): PTX and a cubin per kernel
    python tests/kernels/cross_compile.py gfx942 [--all]   # AMD MI300X (CDNA3, 64-wide wavefronts): AMDGCN, HSA code
                                                           # object
    python tests/kernels/cross_compile.py sm90 --rmsnorm-rows  # the multi-row RMSNorm's arithmetic vs the one-row's

Without --all the launch configurations every kernel runs in for bf16 models (tests/kernels/test_kernels_compile.py,
in `make test`: about half a minute a target); with --all every branch of every host wrapper, fp16 and fp32
included (96 configurations for gfx942, 92 for sm90 on 2026-12-04; 155 for sm90 on 2026-12-05, with the MoE, fused
backward and sweep-tile kernels; about 4 minutes a target on 2 CPU cores with a cold
Triton cache: the attention kernel takes 5-16 s to build for either target, its fp32 IEEE form 77-91 s for
sm90).

How: Triton's compiler needs no GPU, only a target. A stand-in driver (``CompileOnlyDriver``) tells Triton
the target; the kernels' own host wrappers run on CPU tensors (their Triton branch forced on, their device
queries answered for the target: SM/CU count, TMA on Hopper only) and every ``kernel[grid](...)`` they issue
is compiled (``JITFunction.run`` with ``warmup=True``: compile, do not launch) instead of launched. The
kernels' outputs are never computed, so this checks that each kernel builds for the target, not its bits.
Prints, per launch configuration, a line before building it (``building``: what a compiler abort leaves as
the last line) and one after (kernel, constexprs, warps, stages, what the compiler produced or its error,
registers a thread and spill bytes), then a summary line (naming the configurations that spill); exits 1 if
any configuration failed to build.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> (GPUTarget arguments, what a built kernel must hold, SMs / CUs, Hopper's TMA)
TARGETS = {
    "sm90": (("cuda", 90, 32), "cubin", 132, True),
    "gfx942": (("hip", "gfx942", 64), "hsaco", 304, False),
}
MODULES = ("attention", "gradients", "grouped_linear", "logprobs", "matmul", "moe", "rmsnorm", "rope", "silu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class CompileOnlyDriver:
    """The part of Triton's driver interface that compiling (``JITFunction.run(..., warmup=True)``) asks for:
    the target, a device index and a stream. Nothing is ever launched through it."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _launches(target_name: str, every: bool) -> list[dict]:
    """Run the host wrappers' Triton branches (``_drive``) with every launch compiled for ``target_name``
    instead; returns one record per launch. The process stays compile-only afterwards (its driver is the
    stand-in: a CPU machine has no other)."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    spec, artifact, units, has_tma = TARGETS[target_name]
    driver.set_active(CompileOnlyDriver(GPUTarget(*spec)))
    modules = {name: importlib.import_module(f"alignaudit_kernels.{name}") for name in MODULES}
    for module in (m for name in MODULES for m in _module_files(name).values()):  # a package's modules too
        if hasattr(module, "use_triton"):
            module.use_triton = lambda x: True
        if hasattr(module, "sm_count"):
            module.sm_count = lambda device: units
        if hasattr(module, "rocm"):
            module.rocm = lambda: spec[0] == "hip"
    matmul = modules["matmul"].launch  # the strict linear's host wrappers and plans
    matmul._tma_available = lambda x2, w, b: (
        has_tma and b is None and x2.dtype in (BF16, FP16) and x2.shape[1] % 8 == 0 and w.shape[0] % 8 == 0
    )
    records: list[dict] = []
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        started = time.perf_counter()
        record = {
            "target": target_name,
            "kernel": self.fn.__name__,
            "module": self.fn.__module__.split(".")[-1],
            "constexprs": {k: v for k, v in kwargs.items() if k.isupper()},
            "num_warps": kwargs.get("num_warps"),
            "num_stages": kwargs.get("num_stages"),
            "dtypes": sorted({str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)}),
        }
        # a compiler that aborts (LLVM's UNREACHABLE) ends the process: this line names what it was building
        print(json.dumps({"building": record}), flush=True)
        try:
            kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
            record["built"] = sorted(kernel.asm)
            record["ok"] = artifact in kernel.asm and len(kernel.asm[artifact]) > 0
            record.update(_resources(kernel.asm))
        except Exception as error:  # one failing configuration must not hide the others
            record["ok"] = False
            record["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:400]
            record["traceback"] = traceback.format_exc()[-1500:]
        record["seconds"] = round(time.perf_counter() - started, 3)
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "traceback"}), flush=True)
        return None

    JITFunction.run = compile_only
    try:
        _drive(modules, every, amd=spec[0] == "hip")
    finally:
        JITFunction.run = real_run
    return records


def _resources(asm: dict) -> dict:
    """Registers a thread and spill bytes of one built kernel (a spill is local memory traffic in the loop),
    read from what the compiler produced: ``cuobjdump -res-usage`` of the cubin (REG, STACK: the per-thread
    stack, which only spills use here), or the AMDGCN assembly's NumVgprs and ScratchSize comments. Empty where
    neither can be read (no cuobjdump beside Triton's ptxas)."""
    import triton

    if "amdgcn" in asm:
        text = asm["amdgcn"]
        regs, scratch = re.search(r"; NumVgprs: (\d+)", text), re.search(r"; ScratchSize: (\d+)", text)
        return {"registers": int(regs[1]), "spill_bytes": int(scratch[1])} if regs and scratch else {}
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if "cubin" not in asm or not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(found[1]), "spill_bytes": int(found[2])} if found else {}


def _empty(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


def _drive(m: dict, every: bool, amd: bool) -> None:
    """The configurations. Default: every launched kernel at least once, in what models run (bf16, the
    Qwen3-8B shape: hidden 4096, 32 query heads over 8 KV heads, head dim 128, MLP 12288, vocabulary 151936),
    each host-side branch of the products (decode tile, K split plus tree kernel, large tile or Hopper's TMA
    kernel, a row-parallel fp32 partial), prefill and split decode attention; for AMD also the fp32 attention
    with its own launch (attention._launch); the fused backward kernels, the grouped MoE products and the MoE
    combine.
    ``every``: each branch of each host wrapper, also in fp16 and fp32 and at the Qwen2.5-0.5B (896, 14 over 2,
    head dim 64) and Qwen3-14B (40 over 8) shapes."""
    matmul, attention, logprobs = m["matmul"].launch, m["attention"], m["logprobs"]  # matmul: its host wrappers
    if not every:
        w = _empty(4096, 4096)
        for rows, segments, out in ((8, 1, None), (8, 4, None), (512, 1, None), (512, 4, FP32)):
            matmul._triton(_empty(rows, 4096), w, None, segments=segments, out_dtype=out)
        _medium_class(matmul, w)
        _device_descriptors(matmul, w, every, amd)
        m["rmsnorm"]._triton(_empty(16, 4096), _empty(4096), 1e-6, _empty(16, 4096))
        m["rmsnorm"]._triton(_empty(16 * 32, 128), _empty(128), 1e-6, None)  # narrow rows: 8 rows a program
        tables = (_empty(64, 64, dtype=FP32), _empty(64, 64, dtype=FP32))
        m["rope"]._triton(_empty(16, 32, 128), torch.arange(16), *tables)
        m["rope"]._triton(_empty(16, 32, 128), torch.arange(16), *tables, k=_empty(16, 8, 128))  # q and k, one launch
        m["silu"]._triton(_empty(16, 12288), _empty(16, 12288))
        logits = _empty(4, 151936)
        logprobs._log_softmax(logits)
        logprobs._token_logprobs(logits, torch.zeros(4, dtype=torch.int64))
        _attention(attention, BF16, 32, 8, 128, "portable", every_path=False)
        _gradients(m["gradients"], BF16)
        _grouped(m["grouped_linear"], BF16, tokens=64)
        m["moe"]._weighted_sum_triton(_empty(64, 8, 2048), _empty(64, 8, dtype=FP32))
        if amd:
            _attention(attention, FP32, 32, 8, 128, "portable", every_path=False, decode=False)
        return
    for rows in (8, 64, 512):  # the tile classes (matmul.tile_for) and, on Hopper, the TMA plans
        x = _empty(rows, 4096)
        for segments in m["matmul"].SEGMENT_COUNTS:  # > 1: in-kernel tree, or split K plus the tree kernel
            matmul._triton(x, _empty(4096, 4096), None, segments=segments)
        matmul._triton(x, _empty(4096, 4096), None, segments=4, out_dtype=FP32)  # a row-parallel partial
    matmul._triton(_empty(64, 4096), _empty(24576, 4096), None)  # small_wide (N >= WIDE_N)
    _medium_class(matmul, _empty(4096, 4096))
    _device_descriptors(matmul, _empty(4096, 4096), every, amd)
    matmul._triton(_empty(64, 4096), _empty(4096, 4096), _empty(4096))  # a bias: never the TMA kernel
    for dtype in (FP16, FP32):
        matmul._triton(_empty(512, 4096, dtype=dtype), _empty(4096, 4096, dtype=dtype), None)
        matmul._triton(_empty(8, 4096, dtype=dtype), _empty(4096, 4096, dtype=dtype), None, segments=4)
    for dtype in (BF16, FP32):
        _rmsnorm(m["rmsnorm"], dtype)
        for heads, kv_heads, d in ((32, 8, 128), (14, 2, 64)):
            cos = sin = _empty(64, d // 2, dtype=FP32)
            m["rope"]._triton(_empty(16, heads, d, dtype=dtype), torch.arange(16), cos, sin)
            m["rope"]._triton(
                _empty(16, heads, d, dtype=dtype), torch.arange(16), cos, sin, k=_empty(16, kv_heads, d, dtype=dtype)
            )
        m["silu"]._triton(_empty(16, 12288, dtype=dtype), _empty(16, 12288, dtype=dtype))
        logits = _empty(4, 151936, dtype=dtype)
        logprobs._log_softmax(logits)
        logprobs._token_logprobs(logits, torch.zeros(4, dtype=torch.int64))
    for exp in attention.EXP_CHOICES:
        _attention(attention, BF16, 32, 8, 128, exp, every_path=exp == "portable")
    _attention(attention, BF16, 14, 2, 64, "portable", every_path=False)
    _attention(attention, BF16, 40, 8, 128, "portable", every_path=False)
    for dtype in (FP16, FP32):
        _attention(attention, dtype, 32, 8, 128, "portable", every_path=False)
    for dtype in (BF16, FP16, FP32):
        _gradients(m["gradients"], dtype)
        for tokens in (2, 512, 4096):  # the grouped products' tile classes (tiny, small, tall: grouped_tile)
            _grouped(m["grouped_linear"], dtype, tokens)
        m["moe"]._weighted_sum_triton(_empty(64, 8, 2048, dtype=dtype), _empty(64, 8, dtype=FP32))
    for tile in m["grouped_linear"].SWEEP_TILES:  # the tiles bench/moe_gpu.py --tiles times
        _grouped(m["grouped_linear"], BF16, 4096, tile)


def _rmsnorm(rmsnorm, dtype) -> None:
    for h, residual in ((4096, False), (4096, True), (896, False)):  # BLOCK_H and warps by hidden size
        rmsnorm._triton(
            _empty(16, h, dtype=dtype), _empty(h, dtype=dtype), 1e-6, _empty(16, h, dtype=dtype) if residual else None
        )
    for rows in (2, 4, 8, 16, 32):  # the multi-row kernel as bench/sweep_gpu.py rmsnorm-rows times it
        rmsnorm._triton(_empty(16 * 32, 128, dtype=dtype), _empty(128, dtype=dtype), 1e-6, None, rows=rows)


def _gradients(gradients, dtype) -> None:
    """The fused backward kernels (ALIGNAUDIT_BACKWARD=fused) at the Qwen3-8B shape."""
    rows = _empty(16, 4096, dtype=dtype)
    gradients.rms_norm_grad(rows, _empty(4096, dtype=dtype), 1e-6, rows)
    gradients.silu_mul_grad(*(_empty(16, 12288, dtype=dtype) for _ in range(3)))
    cos = sin = _empty(64, 64, dtype=FP32)
    gradients.rope_grad(_empty(16, 32, 128, dtype=dtype), torch.arange(16), cos, sin)


def _grouped(grouped_linear, dtype, tokens: int, tile=None) -> None:
    """The grouped MoE products (the default dispatch on CUDA) at the Qwen3-30B-A3B layer (hidden 2048, 128 experts
    of width 768, top-8): the one-launch plan, gate_up gathering the tokens, down over the sorted rows stored back in
    pair order; at grouped_tile's tile, or ``tile``."""
    chosen = torch.randint(0, 128, (tokens, 8))
    block_m = tile[0] if tile else grouped_linear.block_m_for(chosen.numel(), 128, dtype)
    plan = grouped_linear.plan_experts_triton(chosen, 128, block_m)
    grouped_linear.grouped_linear(
        _empty(tokens, 2048, dtype=dtype), _empty(128, 1536, 2048, dtype=dtype), plan, gather=True, tile=tile
    )
    grouped_linear.grouped_linear(
        _empty(tokens * 8, 768, dtype=dtype),
        _empty(128, 2048, 768, dtype=dtype),
        plan,
        gather=False,
        tile=tile,
        scatter=True,
    )


def _device_descriptors(matmul, w, every: bool, amd: bool) -> None:
    """The TMA products with descriptors made on the device (matmul.TMA_DESCRIPTORS' candidate; Hopper only) at
    the large class's plans, whole, in 4 segments and as a 4-segment fp32 partial (``every``: each class's, and 8
    segments too)."""
    if amd:
        return
    for (size, narrow), (tile, persistent) in matmul.TMA_PLANS.items():
        if every or size == "large":
            for segments in ((4, 8) if every else (4,)) if narrow else (1,):
                matmul._triton_tma(_empty(512, 4096), w, tile, persistent, segments=segments, descriptors="device")
            if narrow:  # a row-parallel partial: the fp32 accumulator stored unrounded
                matmul._triton_tma(
                    _empty(512, 4096), w, tile, persistent, segments=4, out_dtype=FP32, descriptors="device"
                )


def _medium_class(matmul, w) -> None:
    """The medium class (default on: 17-128 rows; on Hopper a 64x128 TMA tile, or one
    program per tile and K segment plus the tree kernel), at both of its split tiles and as a partial."""
    enabled = matmul.medium_class_enabled
    matmul.medium_class_enabled = lambda: True
    try:
        for rows, segments, out in ((32, 1, None), (32, 4, None), (128, 4, None), (128, 4, FP32)):
            matmul._triton(_empty(rows, 4096), w, None, segments=segments, out_dtype=out)
    finally:
        matmul.medium_class_enabled = enabled


def _attention(
    attention, dtype, heads: int, kv_heads: int, d: int, exp: str, every_path: bool, decode: bool = True
) -> None:
    """Prefill of 4096 whole-sequence rows (contiguous K/V; one program per (tile, KV head)) and a decode step
    of 2 sequences over page-aligned pages with max_seq_len 2048 (the key chunks split over programs, then
    the combine kernel). ``every_path`` adds split prefill, a batch over contiguous K/V, decode over gathered
    pages, unsplit decode, and paged prefill."""
    scale = d**-0.5
    for length in (64, 4096) if every_path else (4096,):  # 64 rows, 4096 keys: split; 4096 rows: not
        q, kv = _empty(length, heads, d, dtype=dtype), _empty(length, kv_heads, d, dtype=dtype)
        attention.functions._contiguous_forward(q, kv, kv, torch.tensor([0, length]), scale, exp=exp)
        if dtype != FP32:  # the fused backward's forward keeps each row's log-sum-exp (FlashAttention-2: bf16/fp16)
            attention.functions._contiguous_forward(
                q, kv, kv, torch.tensor([0, length]), scale, exp=exp, lse=_empty(heads, length, dtype=FP32)
            )
    if not every_path:
        if decode:
            pages = _empty(256, attention.BLOCK_N * 2, kv_heads, d, dtype=dtype)
            attention.paged_decode(
                _empty(2, heads, d, dtype=dtype),
                pages,
                pages,
                torch.arange(256, dtype=torch.int32).reshape(2, 128),
                torch.full((2,), 100, dtype=torch.int32),
                scale,
                max_seq_len=2048,
                exp=exp,
            )
        return
    kv = _empty(2, 128, kv_heads, d, dtype=dtype)
    attention.functions._causal_forward(
        _empty(2, 128, heads, d, dtype=dtype), kv, kv, torch.arange(128).expand(2, 128), scale, exp
    )
    for block_size in (16, attention.BLOCK_N * 2):  # KV_GATHER, KV_PAGE_ALIGNED
        pages = _empty(256, block_size, kv_heads, d, dtype=dtype)
        table = torch.arange(256, dtype=torch.int32).reshape(2, 128)
        for rows in (2, 64):  # 2 sequences of up to 2048 keys: split; 64 of 100: not
            attention.paged_decode(
                _empty(rows, heads, d, dtype=dtype),
                pages,
                pages,
                table.repeat(32, 1)[:rows],
                torch.full((rows,), 100, dtype=torch.int32),
                scale,
                max_seq_len=2048 if rows == 2 else 100,
                exp=exp,
            )
        attention.paged_attention(
            _empty(64, heads, d, dtype=dtype),
            pages,
            pages,
            table,
            torch.cat([torch.arange(40), torch.arange(24) + 500]),
            torch.tensor([0] * 40 + [1] * 24),
            scale,
            exp=exp,
        )


def launched_kernels() -> set[str]:
    """Every Triton kernel a host wrapper in alignaudit_kernels launches: the JITFunctions whose name is
    followed by a launch grid (``name[...](``) in their module's source."""
    import re

    from triton.runtime.jit import JITFunction

    names = set()
    for name in MODULES:
        for file, module in _module_files(name).items():
            for launched in re.findall(r"\b(_\w+_kernel)\[", file.read_text()):
                if isinstance(getattr(module, launched, None), JITFunction):
                    names.add(launched)
    return names


def _module_files(name: str) -> dict:
    """{source file: imported module} of alignaudit_kernels.NAME: the module, or each module of a package
    (attention/)."""
    import importlib

    package = importlib.import_module(f"alignaudit_kernels.{name}")
    if not package.__file__.endswith("__init__.py"):
        return {Path(package.__file__): package}
    return {
        file: importlib.import_module(f"alignaudit_kernels.{name}.{file.stem}") if file.stem != "__init__" else package
        for file in sorted(Path(package.__file__).parent.glob("*.py"))
    }


FLOAT_OP = re.compile(r"\s+(?:add|sub|mul|div|sqrt|rcp|fma|shfl|cvt\.f32|cvt\.rn\.(?:bf16|f16)\.f32)\.")


def float_dataflow(ptx: str) -> list[str]:
    """The PTX's floating-point instructions (arithmetic, conversions, warp shuffles) in program order, registers
    renamed by first use: two kernels with equal lists compute each value by the same operations on the same
    operands (ptxas does not reassociate .rn arithmetic)."""
    names: dict[str, str] = {}
    rename = lambda m: names.setdefault(m.group(0), f"r{len(names)}")  # noqa: E731
    return [
        re.sub(r"%\w+", rename, line.strip())
        for line in ptx.splitlines()
        if FLOAT_OP.match(line) and not re.search(r"\.[su](?:32|64)\b", line)
    ]


def row_layout(ttgir: str) -> tuple:
    """The layout of the kernel's first load (x), along its last axis (a row): (elements a thread, lanes, warps,
    whether that axis is the fastest). With the load's PTX vector width it fixes which elements of a row each
    thread holds, and so which values ``float_dataflow``'s registers carry."""
    load = re.search(r"tt\.load [^\n]*: tensor<[^\n]*, (#\w+)>", ttgir).group(1)
    layout = re.search(rf"^{load} = #ttg\.blocked<\{{(.*)\}}>", ttgir, re.M).group(1)
    fields = {k: [int(v) for v in vs.split(",")] for k, vs in re.findall(r"(\w+) = \[([\d, ]+)\]", layout)}
    last = len(fields["order"]) - 1
    return (
        fields["sizePerThread"][last],
        fields["threadsPerWarp"][last],
        fields["warpsPerCTA"][last],
        fields["order"][0] == last,
    )


def rmsnorm_rows_arithmetic(target_name: str) -> list[dict]:
    """For each row width (head_dim 64 and 128; hidden 896 and 4096 at 2 rows) and rows a program: whether the multi-row
    RMSNorm kernel (rmsnorm._rmsnorm_rows_kernel, the default for rows of <= 128) builds to the one-row kernel's
    arithmetic, bf16 with and without the residual add. ``same_reduction``: equal ``float_dataflow`` up to the last
    division (the residual add and its rounding, the squares, the sum's tree, the mean, 1 / sqrt): what could change
    a row's bits. ``same_operations``: the same rounding operations, by kind and count, in the whole kernel; after
    the reduction they are elementwise (x * inv, then * w, then the rounding: in any layout the same bits). Upcasts
    to fp32 are exact and not counted: the weight may be loaded and upcast in another layout, fewer elements a
    thread, before the reduction ends, and moved to x's. ``same_row_layout``: x's layout along a row (``row_layout``)
    and its first PTX load's vector width are the same, so a thread's registers hold the same elements of its row:
    without it equal dataflows could add other elements in another order (a strided, unvectorized load). The dataflow
    does not see loads, stores and moves, so shared-memory exchanges between a row's warps (hidden 896 and 4096) are
    compared only through the layout; the bits themselves are the GPU run's to confirm (it did at head dim 128 on an
    H100, 2026-12-06)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from alignaudit_kernels import rmsnorm

    driver.set_active(CompileOnlyDriver(GPUTarget(*TARGETS[target_name][0])))
    rmsnorm.use_triton = lambda x: True
    real_run, built = JITFunction.run, []
    JITFunction.run = lambda self, *a, grid, warmup, **k: built.append(real_run(self, *a, grid=grid, warmup=True, **k))

    def split(flow: list[str]) -> tuple[list[str], list[str]]:
        last = max(i for i, line in enumerate(flow) if line.startswith("div.rn.f32"))
        ops = (line.split()[0] for line in flow)
        return flow[: last + 1], sorted(op for op in ops if not op.startswith("cvt.f32."))

    results = []
    try:
        for h, rows_choices in ((64, (8, 32)), (128, (2, 4, 8, 16, 32)), (896, (2, 8)), (4096, (2,))):
            for residual in (False, True):
                for rows in rows_choices:
                    built.clear()
                    for r in (1, rows):
                        rmsnorm._triton(_empty(64, h), _empty(h), 1e-6, _empty(64, h) if residual else None, rows=r)
                    (one, one_rest), (many, many_rest) = (split(float_dataflow(k.asm["ptx"])) for k in built)
                    layouts = [
                        (row_layout(k.asm["ttgir"]), re.search(r"ld\.global\S*", k.asm["ptx"]).group(0)) for k in built
                    ]
                    results.append(
                        {
                            "h": h,
                            "residual": residual,
                            "rows": rows,
                            "reduction_operations": len(one),
                            "same_reduction": one == many,
                            "same_operations": one_rest == many_rest,
                            "same_row_layout": layouts[0] == layouts[1],
                            "row_layout": layouts[1],
                        }
                    )
        # the control: 8 rows on 4 warps (two rows a warp, 16 lanes a row, 8 elements a thread) is another tree
        built.clear()
        x, w = _empty(64, 128), _empty(128)
        rmsnorm._triton(x, w, 1e-6, None, rows=1)
        rmsnorm._rmsnorm_rows_kernel[(8,)](
            x,
            x,
            w,
            x,
            x,
            64,
            128,
            1e-6,
            1,
            128,
            0,
            0,
            128,
            128,
            HAS_RESIDUAL=False,
            ROWS=8,
            BLOCK_H=128,
            num_warps=4,
            enable_fp_fusion=False,
        )
        (one, _), (many, _) = (split(float_dataflow(k.asm["ptx"])) for k in built)
        results.append(
            {
                "h": 128,
                "control": "8 rows on 4 warps",
                "same_reduction": one == many,
                "same_row_layout": row_layout(built[0].asm["ttgir"]) == row_layout(built[1].asm["ttgir"]),
            }
        )
    finally:
        JITFunction.run = real_run
    return results


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else ""
    if target in TARGETS and sys.argv[2:] == ["--rmsnorm-rows"]:
        for result in rmsnorm_rows_arithmetic(target):
            print(json.dumps(result), flush=True)
        return
    if target not in TARGETS or sys.argv[2:] not in ([], ["--all"]):
        raise SystemExit(
            f"usage: python tests/kernels/cross_compile.py {{{','.join(TARGETS)}}} [--all | --rmsnorm-rows]"
        )
    started = time.perf_counter()
    records = _launches(target, every=sys.argv[2:] == ["--all"])
    failed = [r for r in records if not r["ok"]]
    for record in failed[:3]:
        print(record.get("traceback", ""), file=sys.stderr)
    print(
        json.dumps(
            {
                "summary": target,
                "configurations": len(records),
                "failed": len(failed),
                "kernels": sorted({r["kernel"] for r in records if r["ok"]}),
                "launched_in_source": sorted(launched_kernels()),
                "spilling": sorted(
                    {
                        f"{r['kernel']} ({r['num_warps']} warps, {r['spill_bytes']} bytes)"
                        for r in records
                        if r.get("spill_bytes")
                    }
                ),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
