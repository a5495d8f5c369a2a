"""Strict attention inside vLLM: what both platforms' backends share, and the CPU platform's backend.

Every strict backend computes alignaudit_kernels' paged attention over vLLM's own paged KV cache, so prompt
rows (prefill, chunked or not) and generated rows (decode) of a sequence go through one arithmetic, the one
Megatron's and HF's strict attention compute. The backends (registered by alignaudit.engines.vllm.plugin):
    CPU   StrictCPUAttentionBackend over CPU_ATTN (vLLM's CPU platform selects nothing else), below
    CUDA  StrictFlashAttentionBackend over FLASH_ATTN (alignaudit.engines.vllm.attention_cuda)

The CPU backend keeps vLLM's CPU_ATTN metadata builder and KV cache tensor ([num_blocks, num_kv_heads,
block_size, 2 * head_size]; keys in the first block_size rows of each (block, head) slab, values in the
rest), but writes K/V into it with plain indexing and reads them with the strict kernel.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

import alignaudit_kernels as K
from alignaudit.inputs.strict_ops import ATTENTION_ENV, EXP_ENV, STRICT_ATTENTIONS, STRICT_EXPS


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, q_seq: torch.Tensor) -> torch.Tensor:
    """Absolute position of each query row of a vLLM batch, computed where the inputs live (no host read).

    Request r's query rows are the last ``query_start_loc[r + 1] - query_start_loc[r]`` of its
    ``seq_lens[r]`` tokens (vLLM's CommonAttentionMetadata). query_start_loc [R + 1], seq_lens [R] int;
    q_seq [T] the request of each row, on the same device. Returns int64 [T].
    """
    starts = query_start_loc[:-1].long()
    context = seq_lens.long() - (query_start_loc[1:].long() - starts)
    rows = torch.arange(q_seq.shape[0], device=q_seq.device)
    return context[q_seq] - starts[q_seq] + rows


def request_of_rows(query_start_loc_cpu: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """[T] int64 (CPU): the request index of every query row of the first ``num_reqs`` requests. In numpy: it runs on
    the host every step (alignaudit_kernels.attention.launch._tiles says why)."""
    starts = query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
    return torch.from_numpy(np.repeat(np.arange(num_reqs, dtype=np.int64), np.diff(starts)))


def configured_exp() -> str:
    """The exp strict attention computes in vLLM: ALIGNAUDIT_STRICT_EXP ("portable", the default, or "native",
    the GPU's exp2 instruction; alignaudit_kernels.attention). Raises ValueError for another value."""
    exp = os.environ.get(EXP_ENV) or STRICT_EXPS[0]
    if exp not in STRICT_EXPS:
        raise ValueError(f"{EXP_ENV}={exp!r}: choose {' or '.join(STRICT_EXPS)}")
    return exp


def attention_impls(model: torch.nn.Module) -> dict[str, str | None]:
    """``{impl class name: exp}`` of every attention layer of a loaded vLLM model (exp None where the impl is
    not strict): what actually computes attention, read back rather than assumed from the registration."""
    return {
        type(m.impl).__name__: getattr(m.impl, "strict_exp", None)
        for m in model.modules()
        if hasattr(m, "impl") and hasattr(m, "attn_backend")
    }


def attention_kernels(model: torch.nn.Module) -> list[str]:
    """The strict attention kernels (alignaudit_kernels.attention.KERNELS) that the attention layers of a loaded vLLM
    model compute with, read back from their impls; [] where none is strict."""
    return sorted(
        {
            getattr(m.impl, "strict_kernel", "portable")
            for m in model.modules()
            if hasattr(m, "impl") and hasattr(m, "attn_backend") and hasattr(m.impl, "strict_exp")
        }
    )


def configured_kernel() -> str:
    """The strict attention kernel in vLLM: ALIGNAUDIT_STRICT_ATTENTION ("portable", the default, or "flash",
    FlashAttention-3 at one key split; alignaudit_kernels.attention.flash). Raises ValueError for another value."""
    kernel = os.environ.get(ATTENTION_ENV) or STRICT_ATTENTIONS[0]
    if kernel not in STRICT_ATTENTIONS:
        raise ValueError(f"{ATTENTION_ENV}={kernel!r}: choose {' or '.join(STRICT_ATTENTIONS)}")
    return kernel


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views [num_blocks, num_kv_heads, block_size, head_size] of the CPU cache tensor."""
    blocks, heads, block_size, _ = kv_cache.shape
    kv = kv_cache.view(blocks, heads, 2 * block_size, -1)
    return kv[:, :, :block_size], kv[:, :, block_size:]


class StrictCPUAttentionImpl(CPUAttentionBackendImpl):
    strict_exp = "portable"  # the CPU backend of the kernels computes no other

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.attn_type != AttentionType.DECODER:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key_cache, value_cache = _split(kv_cache)
        n = slot_mapping.shape[0]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        block, offset = slots // key_cache.shape[2], slots % key_cache.shape[2]
        key_cache[block, :, offset] = key[:n][valid]
        value_cache[block, :, offset] = value[:n][valid]

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if attn_metadata is None:  # warm-up
            return output
        if self.attn_type != AttentionType.DECODER or self.sliding_window != -1 or self.sinks is not None:
            raise NotImplementedError(
                "strict attention supports causal decoder attention without sliding window or sinks"
            )
        n = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc
        seqs = torch.repeat_interleave(torch.arange(qsl.shape[0] - 1), qsl[1:] - qsl[:-1])
        positions = token_positions(qsl, attn_metadata.seq_lens, seqs)
        key_cache, value_cache = _split(kv_cache)
        out = K.paged_attention(
            query[:n],
            key_cache.transpose(1, 2),
            value_cache.transpose(1, 2),
            attn_metadata.block_table,
            positions,
            seqs,
            self.scale,
        )
        output[:n] = out.reshape(output[:n].shape)
        return output


class StrictCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return StrictCPUAttentionImpl
