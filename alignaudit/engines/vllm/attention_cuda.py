"""A vLLM attention backend for CUDA that computes alignaudit_kernels' paged attention.

Registered over FLASH_ATTN (the backend vLLM selects on Hopper, and one that declares batch invariance) by
alignaudit.engines.vllm.plugin. It keeps FlashAttention's KV cache (logical [num_blocks, num_kv_heads,
block_size, 2 * head_size], stored [num_blocks, block_size, num_kv_heads, 2 * head_size]: keys in the first
head_size columns, values in the rest; vllm/v1/attention/backends/flash_attn.py) and its cache write
(reshape_and_cache_flash: a copy, no arithmetic), and replaces the attention:

    decode batch (every request one new token): alignaudit_kernels.paged_decode, which reads only vLLM's
        persistent buffers (seq_lens, block_table) and the host constant max_model_len, so a CUDA graph
        captures it (vLLM's FULL graphs for uniform decode batches, padded requests have seq_lens 0);
    any other batch (prefill, chunked prefill, prefill mixed with decode): alignaudit_kernels.paged_attention
        with a plan made once per step (each query row's request on the host, its position on the device,
        vLLM's max_seq_len as the bound on keys: the metadata builder; the query tiles: the step's first
        layer), so no layer reads the device and only the first plans on the host.

Both give a query row the bits of a prefill of the same tokens (kernels/alignaudit_kernels/attention/), which is what
the strict attention of Megatron and HF computes. CUDA graphs: the builder declares UNIFORM_SINGLE_TOKEN_DECODE,
the support it really has: vLLM then captures FULL graphs for decode batches only and runs other batches
piecewise, attention outside the graphs (vllm/config/compilation.py resolve_cudagraph_mode_and_sizes). The
metadata of those batches holds fresh tensors each step, which a FULL graph would bake in stale (an
over-claiming builder gives stale sequence lengths on replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, AttentionType
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

import alignaudit_kernels as K
from alignaudit.engines.vllm.attention_cpu import configured_exp, configured_kernel, request_of_rows, token_positions
from alignaudit_kernels.attention import (
    BLOCK_N,
    CHUNK_N,
    SPLIT_BELOW_PROGRAMS_PER_SM,
    QueryTiles,
    flash_paged,
    paged_tiles,
)
from alignaudit_kernels.primitives import sm_count, to_device


@dataclass
class StrictAttentionMetadata:
    """One step's attention plan, shared by every layer.

    Attributes:
        num_actual_tokens: query rows of the step that belong to a request (vLLM pads the rest).
        max_query_len, max_seq_len: host ints from vLLM (max_seq_len is an upper bound on keys).
        query_start_loc [R + 1], seq_lens [R], block_table [R, max_blocks], slot_mapping [tokens]: vLLM's
            persistent device buffers (int32), R the (padded) request count.
        decode: every request has one query row: the paged_decode path.
        decode_bound: max_model_len, the key bound of every decode step (constant, so a graph may hold it).
        positions [num_actual_tokens] (device, int32) and q_seq [num_actual_tokens] (CPU, int64): the
            position and the request of each query row; None for a decode batch.
        tiles: the query tiles of q_seq (alignaudit_kernels.attention.paged_tiles), planned by the step's first
            layer and reused by the others; None until then, and for a decode batch.
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    decode: bool
    decode_bound: int
    positions: torch.Tensor | None = None
    q_seq: torch.Tensor | None = None
    tiles: QueryTiles | None = None
    causal: bool = True
    use_cascade: bool = False


class StrictAttentionMetadataBuilder(AttentionMetadataBuilder[StrictAttentionMetadata]):
    """Builds StrictAttentionMetadata from vLLM's CommonAttentionMetadata (module docstring)."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.decode_bound = int(vllm_config.model_config.max_model_len)
        self.kernel = configured_kernel()
        if torch.device(device).type == "cuda" and self.kernel == "portable":  # FA3 is built ahead of time
            spec = kv_cache_spec
            warm_up(
                vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config),
                spec.num_kv_heads,
                spec.head_size,
                spec.block_size,
                vllm_config.model_config.dtype,
                spec.dtype,
                torch.device(device),
                configured_exp(),
                self.decode_bound,
            )

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> StrictAttentionMetadata:
        m = common_attn_metadata
        if common_prefix_len:
            raise NotImplementedError("strict attention computes no cascade (shared-prefix) attention")
        if m.causal is not True:
            raise NotImplementedError("strict attention is causal attention only")
        meta = StrictAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            decode=m.max_query_len == 1,
            decode_bound=self.decode_bound,
        )
        if not meta.decode and self.kernel == "portable":  # FA3 reads vLLM's own tensors
            meta.q_seq = request_of_rows(m.query_start_loc_cpu, m.num_reqs)
            meta.num_actual_tokens = int(meta.q_seq.shape[0])
            rows_seq = to_device(meta.q_seq, self.device)
            meta.positions = token_positions(
                m.query_start_loc[: m.num_reqs + 1], m.seq_lens[: m.num_reqs], rows_seq
            ).to(torch.int32)  # the kernel's type: no cast in each layer
        return meta


def warm_up(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: torch.device,
    exp: str,
    decode_bound: int,
) -> None:
    """Run ``strict_attention`` once for each kind of step, on zeros in a small cache of FlashAttention's layout:
    a prefill within one key chunk (the unsplit kernel), one over two chunks (split-KV kernel and merge; where
    max_model_len ``decode_bound`` exceeds one chunk), a decode step of one sequence (split-KV where the bound
    exceeds a chunk) and one of as many sequences as fill the SMs without it. Triton builds a kernel variant at its
    first launch, and vLLM's start never runs strict attention for a prefill (its profile run passes no
    metadata, its graph capture decodes only), so without this the first batches of generation paid those
    builds (docs/log/gpu-sessions.md, 2026-12-04 third session).
    Nothing computed here is kept. dtype: the queries' (the model's), cache_dtype: the KV cache's.
    The block table is as wide as vLLM's (cdiv(max_model_len, block_size) pages a request): Triton specializes
    its row stride on divisibility by 16, so a table of another width could build other variants.
    """
    width = -(-decode_bound // block_size)
    keys = min(CHUNK_N + BLOCK_N, decode_bound)  # two key chunks, where max_model_len allows them
    blocks = -(-keys // block_size)
    kv_cache = torch.zeros(blocks, block_size, num_kv_heads, 2 * head_size, dtype=cache_dtype, device=device).transpose(
        1, 2
    )
    table = torch.zeros(1, width, dtype=torch.int32, device=device)
    table[0, :blocks] = torch.arange(blocks, dtype=torch.int32, device=device)
    # a decode batch of this many sequences fills the SMs without split-KV (attention._launch's choice)
    unsplit = -(-SPLIT_BELOW_PROGRAMS_PER_SM * (sm_count(device) if device.type == "cuda" else 1) // num_kv_heads)
    q = torch.zeros(max(keys, unsplit), num_heads, head_size, dtype=dtype, device=device)
    out = torch.empty_like(q)
    scale = head_size**-0.5

    # Whole plans: one request's prefill of positions [0, rows), or ``sequences`` requests each decoding position
    # keys - 1 (the portable kernel warmed up here reads neither query_start_loc nor slot_mapping).
    def prefill(rows: int) -> StrictAttentionMetadata:
        count = torch.tensor([rows], dtype=torch.int32, device=device)
        return StrictAttentionMetadata(
            num_actual_tokens=rows,
            max_query_len=rows,
            max_seq_len=rows,
            query_start_loc=torch.tensor([0, rows], dtype=torch.int32, device=device),
            seq_lens=count,
            block_table=table,
            slot_mapping=torch.arange(rows, dtype=torch.int64, device=device),
            decode=False,
            decode_bound=decode_bound,
            positions=torch.arange(rows, dtype=torch.int32, device=device),
            q_seq=torch.zeros(rows, dtype=torch.int64),
        )

    def decode(sequences: int) -> StrictAttentionMetadata:
        return StrictAttentionMetadata(
            num_actual_tokens=sequences,
            max_query_len=1,
            max_seq_len=keys,
            query_start_loc=torch.arange(sequences + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((sequences,), keys, dtype=torch.int32, device=device),
            block_table=table.repeat(sequences, 1),
            slot_mapping=torch.full((sequences,), keys - 1, dtype=torch.int64, device=device),
            decode=True,
            decode_bound=decode_bound,
        )

    for meta in (prefill(min(BLOCK_N, keys)), prefill(keys), decode(1), decode(unsplit)):
        rows = meta.num_actual_tokens
        strict_attention(meta, q[:rows], kv_cache, head_size, scale, exp, out[:rows])


def strict_attention(
    meta: StrictAttentionMetadata,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    head_size: int,
    scale: float,
    exp: str,
    output: torch.Tensor,
    kernel: str = "portable",
) -> torch.Tensor:
    """Attention of one layer for one step into ``output`` [tokens, heads, head_size] (rows past the
    requests' are left as they are), reading FlashAttention's KV cache ``kv_cache`` (module docstring). ``kernel``
    "flash": FlashAttention-3 at one key split over vLLM's own metadata, for decode and every other batch alike
    (alignaudit_kernels.attention.flash; a decode batch bounded by max_model_len, as the portable kernel's)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)  # [blocks, block_size, kv_heads, D]
    if kernel == "flash":
        r = meta.seq_lens.shape[0]
        n = r if meta.decode else meta.num_actual_tokens
        flash_paged(
            query[:n],
            key_cache,
            value_cache,
            meta.block_table[:r],
            meta.query_start_loc[: r + 1],
            meta.seq_lens,
            meta.max_query_len,
            meta.decode_bound if meta.decode else meta.max_seq_len,
            scale,
            out=output[:n].view(query[:n].shape),
        )
    elif meta.decode:
        b = meta.seq_lens.shape[0]
        K.paged_decode(
            query[:b],
            key_cache,
            value_cache,
            meta.block_table,
            meta.seq_lens,
            scale,
            meta.decode_bound,
            exp=exp,
            out=output[:b].view(query[:b].shape),
        )
    else:
        n = meta.num_actual_tokens
        group = query.shape[1] // key_cache.shape[2]
        assert meta.q_seq is not None, "a portable prefill plan holds each row's request (build)"
        if meta.tiles is None or meta.tiles.group != group:  # the step's first layer plans for all of them
            meta.tiles = paged_tiles(meta.q_seq, group, query.device)
        K.paged_attention(
            query[:n],
            key_cache,
            value_cache,
            meta.block_table,
            meta.positions,
            meta.q_seq,
            scale,
            exp=exp,
            max_keys=meta.max_seq_len,
            out=output[:n].view(query[:n].shape),
            tiles=meta.tiles,
        )
    return output


class StrictFlashAttentionImpl(FlashAttentionImpl):
    """FlashAttentionImpl with the attention computed by ``strict_attention``; the cache write is vLLM's.

    Raises NotImplementedError at construction for what strict attention does not compute (encoder or
    cross attention, sliding window, ALiBi, soft cap, sinks, a quantized KV cache, decode context
    parallelism), and ValueError for an unknown ALIGNAUDIT_STRICT_EXP.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unsupported = {
            "encoder or cross attention": self.attn_type != AttentionType.DECODER,
            "sliding window": tuple(self.sliding_window) != (-1, -1),
            "ALiBi": self.alibi_slopes is not None,
            "logits soft cap": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "a quantized KV cache": self.kv_cache_dtype not in ("auto", "bfloat16", "float16"),
            "decode context parallelism": self.dcp_world_size > 1,
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise NotImplementedError(f"strict attention in vLLM does not compute {', '.join(found)}")
        self.strict_exp, self.strict_kernel = configured_exp(), configured_kernel()

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("strict attention does not quantize its output")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        return strict_attention(
            attn_metadata, query, kv_cache, self.head_size, self.scale, self.strict_exp, output, self.strict_kernel
        )


class StrictFlashAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN's KV cache layout, block sizes and cache write; strict attention (module docstring)."""

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # a row's bits do not depend on the batch (kernels/alignaudit_kernels/attention/): VLLM_BATCH_INVARIANT=1 may
        # select it
        return True

    @staticmethod
    def get_impl_cls():
        return StrictFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return StrictAttentionMetadataBuilder
