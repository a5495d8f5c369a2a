"""A vLLM attention backend that computes alignaudit_kernels.paged_attention (CPU platform).

It keeps vLLM's CPU_ATTN metadata builder and KV cache tensor ([num_blocks, num_kv_heads, block_size,
2 * head_size]; keys in the first block_size rows of each (block, head) slab, values in the rest), but
writes K/V into it with plain indexing and reads them with the strict kernel, so prompt rows (prefill,
chunked or not) and generated rows (decode) of a sequence go through one arithmetic.
Registered over CPU_ATTN by alignaudit.strict.vllm_plugin (vLLM's CPU platform only selects CPU_ATTN).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

import alignaudit_kernels as K


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views [num_blocks, num_kv_heads, block_size, head_size] of the CPU cache tensor."""
    blocks, heads, block_size, _ = kv_cache.shape
    kv = kv_cache.view(blocks, heads, 2 * block_size, -1)
    return kv[:, :, :block_size], kv[:, :, block_size:]


class StrictCPUAttentionImpl(CPUAttentionBackendImpl):
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

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # warm-up
            return output
        if self.attn_type != AttentionType.DECODER or self.sliding_window != -1 or self.sinks is not None:
            raise NotImplementedError("strict attention supports causal decoder attention without sliding window or sinks")
        n = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        seqs = torch.arange(q_lens.shape[0]).repeat_interleave(q_lens)
        first = (attn_metadata.seq_lens.long() - q_lens).repeat_interleave(q_lens)
        positions = first + torch.arange(n) - qsl[:-1].repeat_interleave(q_lens)
        key_cache, value_cache = _split(kv_cache)
        out = K.paged_attention(query[:n], key_cache.transpose(1, 2), value_cache.transpose(1, 2),
                                attn_metadata.block_table, positions, seqs, self.scale)
        output[:n] = out.reshape(output[:n].shape)
        return output


class StrictCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return StrictCPUAttentionImpl
