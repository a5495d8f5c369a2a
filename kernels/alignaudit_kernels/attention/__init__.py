"""Strict causal attention with GQA: ragged prefill and paged-KV decode produce the same bits per query.

One algorithm for every query row q at absolute position p, whatever else is in the batch:
    keys are visited in logical blocks of BLOCK_N = 64 positions starting at key 0: [0, 64), [64, 128), ...
    per block:   s     = (q . k_j) * scale                    fp32; key j > p masked to -inf
                 m_new = max(m, max_j s)                      exact
                 alpha = exp(m - m_new)                       alignaudit_kernels.primitives.exp (exp(0) = 1 exactly)
                 P     = exp(s - m_new)                       fp32
                 l     = l * alpha + sum_j P                  fp32
                 acc   = acc * alpha + sum_j round(P) * v_j   P rounded to the value dtype first
                                                              (FlashAttention's convention), products fp32
                 (a block with no key <= p leaves m, l, acc untouched, so a batch that visits more
                 blocks for other rows cannot change this row)
    keys are grouped in chunks of CHUNK_N = 512 positions (8 blocks); each chunk's blocks run the steps
    above from a fresh state (m = -inf, l = 0, acc = 0), and the chunk states are folded in left to right:
                 M = max(M, m_c);  a = exp(M_old - M);  b = exp(m_c - M)
                 L = L * a + l_c * b;  A = A * a + acc_c * b  (a chunk with no key <= p is skipped)
    out = A / L                                               rounding point: once, fp32 -> dtype
Query head h reads KV head h // (num_heads / num_kv_heads) (GQA). The chunks are what lets a decode step
split its keys over many programs (split-KV, one program per chunk and a second launch that folds the
states in the same order) and still give the bits of a prefill, which folds them in registers.

exp: "portable" (the default) is alignaudit_kernels.primitives.exp, the same bits on the CPU and on every GPU
backend; "native" is the GPU's exp2 instruction (tl.exp: MUFU.EX2 after a multiply by log2(e) on NVIDIA), 1.4-1.8x
faster prefill on an H200 (docs/benchmarks.md) and the same bits wherever one GPU architecture runs every
engine, but not the CPU backend's bits (it refuses "native").

Reductions: the dot products over head_dim and the sums over the keys of a block. CPU: products in fp32,
alignaudit_kernels.primitives.fixed_sum (blocks of 32, pairwise tree, blocks left to right). GPU (Triton): tl.dot
on tensor cores (fp32 inputs use IEEE products, not TF32), row sums by tl.sum; one kernel for prefill and
decode, reading K/V through a block table, with a tile of 64 query rows (floor(64 / group) tokens x the
group's heads; rows past that masked, so any group size up to 64 works), so a row's arithmetic does not
depend on how many tokens share its tile. A decode tile holds one token: its heads sit 64 / USED rows apart
(USED: the group size rounded up to a power of two) and only their scores are exponentiated (``_rows``);
P's row sums and P.V still run over the whole tile, so the bits are a prefill's. The key blocks that every
row of a tile sees whole are visited without masks, the others with them: the same steps with every mask true,
so a row gets the same bits whichever loop visits a block (tests/kernels/ checks prefill against
decode on the GPU). Contiguous K/V (training engines) are read in place as one-token pages.

Layouts: q [tokens, heads, head_dim]; K/V either contiguous per sequence [tokens, kv_heads, head_dim]
(training engines) or a paged cache [num_blocks, block_size, kv_heads, head_dim] with a block table
[sequences, max_blocks] (vLLM). Backward (ALIGNAUDIT_BACKWARD): through the plain-torch reference in fp32, or fused:
FlashAttention-2's varlen backward fed the forward's log-sum-exp (``flash_gradients``) or torch's SDPA, both under
torch's deterministic mode.

Kernel: "portable" (above) or "flash", FlashAttention-3 at one key split on Hopper GPUs, whose bits are not the
portable ones but are the same in every layout (``flash``).

The package, one job per module: ``algorithm`` (the fixed sizes and exp choices), ``torch_reference`` (plain
torch: the reference and the backward), ``flash_gradients`` (the fused backward by FlashAttention-2), ``flash``
(the FlashAttention-3 kernel choice), ``cpu`` (the CPU backend), ``triton_steps`` (the algorithm's steps as Triton
device functions), ``triton_kernels`` (the GPU kernels built from them), ``launch`` (tiles, configurations, plans),
``functions`` (the entry points below).
"""

from alignaudit_kernels.attention.algorithm import BLOCK_N, CHUNK_N, DEFAULT_EXP, EXP_CHOICES, TILE_ROWS
from alignaudit_kernels.attention.flash import DEFAULT_KERNEL, KERNELS, flash_paged, flash_unavailable
from alignaudit_kernels.attention.functions import causal_attention, paged_attention, paged_decode, varlen_attention
from alignaudit_kernels.attention.launch import (
    DECODE_CONFIG,
    KV_DIRECT,
    KV_GATHER,
    KV_PAGE_ALIGNED,
    SPLIT_BELOW_PROGRAMS_PER_SM,
    SPLIT_SCRATCH_BYTES,
    TILE_CONFIG,
    QueryTiles,
    _kv_mode,
    _launch,
    _launch_varlen,
    choose_split,
    paged_tiles,
    split_scratch,
    split_scratch_bytes,
)
from alignaudit_kernels.attention.torch_reference import batched_reference, reference

__all__ = [
    "BLOCK_N",
    "CHUNK_N",
    "DECODE_CONFIG",
    "DEFAULT_EXP",
    "DEFAULT_KERNEL",
    "EXP_CHOICES",
    "KERNELS",
    "KV_DIRECT",
    "KV_GATHER",
    "KV_PAGE_ALIGNED",
    "QueryTiles",
    "SPLIT_BELOW_PROGRAMS_PER_SM",
    "SPLIT_SCRATCH_BYTES",
    "TILE_CONFIG",
    "TILE_ROWS",
    "_kv_mode",
    "_launch",
    "_launch_varlen",
    "batched_reference",
    "causal_attention",
    "choose_split",
    "flash_paged",
    "flash_unavailable",
    "paged_attention",
    "paged_decode",
    "paged_tiles",
    "reference",
    "split_scratch",
    "split_scratch_bytes",
    "varlen_attention",
]
