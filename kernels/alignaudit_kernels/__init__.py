"""alignaudit_kernels: strict kernels whose results do not depend on batch size, position in the batch,
prefill vs decode, or the engine that calls them.

The package is kernels/alignaudit_kernels/: kernels/ is a plain folder, so a checkout's root on sys.path never
makes this a top-level ``kernels`` (the Hugging Face kernels library, which transformers imports). Each op has a
CPU implementation and a Triton implementation with the same contract, chosen by the tensors' device
(``TRITON_INTERPRET=1`` runs the Triton kernels on CPU tensors). docs/kernels.md tabulates each kernel's
reduction order, precision, rounding points and primitives.
"""

from alignaudit_kernels.attention import causal_attention, paged_attention, paged_decode, varlen_attention
from alignaudit_kernels.logprobs import log_softmax, token_logprobs, token_logprobs_vocab_parallel
from alignaudit_kernels.matmul import ROW_PARALLEL_SEGMENTS, combine_partials, linear, linear_partial
from alignaudit_kernels.moe import combine_experts, mixture_of_experts, route
from alignaudit_kernels.rmsnorm import rms_norm
from alignaudit_kernels.rope import apply_rope, apply_rope_qk, inverse_frequencies, rope_tables
from alignaudit_kernels.silu import silu_and_mul, silu_mul

__all__ = [
    "ROW_PARALLEL_SEGMENTS",
    "apply_rope",
    "apply_rope_qk",
    "causal_attention",
    "combine_experts",
    "combine_partials",
    "inverse_frequencies",
    "linear",
    "linear_partial",
    "log_softmax",
    "mixture_of_experts",
    "paged_attention",
    "paged_decode",
    "rms_norm",
    "rope_tables",
    "route",
    "silu_and_mul",
    "silu_mul",
    "token_logprobs",
    "token_logprobs_vocab_parallel",
    "varlen_attention",
]
