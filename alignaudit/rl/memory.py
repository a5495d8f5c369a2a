"""Will a Megatron trainer and a rollout engine fit on one GPU? Estimated before any engine starts.

Bytes per trainer parameter (N parameters, bf16 model, megatron.core's mixed-precision Adam):
    bf16 weights 2N (and 2N more for the KL term's reference copy); fp32 gradient buffer 4N
    (DistributedDataParallel, grad_reduce_in_fp32, as megatron-lm);
    optimizer state 12N without offload (Float16OptimizerWithFloat16Params: fp32 main weights 4N, Adam
    exp_avg 4N, exp_avg_sq 4N; its main grads are the fp32 buffer itself).
At the Qwen3-8B shape (8.19e9 parameters) that is 147 GB: more than an H200 holds before vLLM takes its
share. Megatron-Core's answer is optimizer CPU offload (megatron/core/optimizer/cpu_offloading,
HybridDeviceOptimizer, behind ``OptimizerConfig.optimizer_cpu_offload`` with the distributed optimizer and
``use_precision_aware_optimizer``, as megatron-lm's ``--optimizer-cpu-offload --optimizer-offload-fraction``):
a fraction f of the parameters keeps its fp32 main weight and Adam state in host memory and is updated there
by torch's CPU Adam, the gradients copied down and the new weights up each step. On that path every
parameter costs 16 bytes of optimizer memory where it is updated: main weight, exp_avg, exp_avg_sq and an
fp32 gradient copy (the pinned host copy for the offloaded part; on the GPU, measured: at f = 0.45 the Qwen3-8B
trainer held 17.5 GB more than 12 bytes per GPU-side parameter predict, 0.55 * 4N = 18.0 GB; H200,
2026-12-01). ``plan`` picks the smallest f (in steps of 0.05) under which the estimate fits the GPU, and
refuses when the host cannot hold f * 16N bytes.

Activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1):
s*b*h*(34 + 5*a*s/h) bytes per layer for 16-bit training without recomputation (s tokens per sequence, b
sequences per micro-batch, a heads), plus the fp32 logits and their log-softmax and gradient (3 * 4 bytes
per token per vocabulary entry). The rollout engine: its weights (2N), its KV cache, and ROLLOUT_OVERHEAD for
activations, CUDA graphs and the CUDA context. HEADROOM of the GPU is left for fragmentation. These are
estimates, recorded as such in run.json; the measured peak is the GPU's to report.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec

GB = 1e9
ROLLOUT_OVERHEAD = 6 * GB
HEADROOM = 0.10  # of the GPU's memory (fragmentation, the estimate's error)
HOST_RESERVE = 16 * GB  # the host's own processes, the engines' Python state, page cache for the checkpoint


def parameter_count(spec: ModelSpec) -> int:
    """Parameters of a dense decoder of ``spec``'s shape: embeddings (and an untied lm_head), per layer the
    q/k/v/o projections (with q/k/v biases where the architecture has them), the SwiGLU MLP, two RMSNorms
    (and Qwen3's q/k norms), and the final norm."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if spec.attention_bias else 0)
    layer = attention + 3 * h * spec.intermediate_size + 2 * h + (2 * hd if spec.qk_norm else 0)
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return embeddings + spec.num_layers * layer + h


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate (bytes) and the optimizer offload fraction chosen. ``offload_fraction`` 0: everything on
    the GPU (megatron.core's Float16Optimizer, as without a plan)."""

    parameters: int
    offload_fraction: float
    gpu_total: int
    host_total: int
    trainer_weights_and_grads: float  # bf16 weights (and the reference copy) and the fp32 gradient buffer
    optimizer_on_gpu: float
    activations: float
    rollout: float
    optimizer_on_host: float

    @property
    def gpu_needed(self) -> float:
        return self.trainer_weights_and_grads + self.optimizer_on_gpu + self.activations + self.rollout

    def record(self) -> dict:
        return {**asdict(self), "gpu_needed": self.gpu_needed, "estimate": "alignaudit.rl.memory (module docstring)"}


def plan(
    spec: ModelSpec,
    sequences: int,
    seq_len: int,
    micro_batch: int,
    kv_cache_bytes: float,
    gpu_total: int,
    host_total: int,
    reference: bool = False,
    tensor_parallel: int = 1,
    rollout_bytes: float | None = None,
) -> MemoryPlan:
    """The smallest optimizer offload fraction under which trainer and rollout engine fit one GPU.

    Args:
        sequences: sequences per training step; seq_len: tokens per sequence (prompt + completion);
        micro_batch: sequences per forward pass (<= sequences); kv_cache_bytes: the rollout engine's KV cache;
        gpu_total, host_total: bytes of GPU and host memory. reference: the trainer keeps a bf16 copy of the
        starting weights (the KL term's reference policy, 2N more). tensor_parallel: the trainer's size t;
        the GPU checked is rank 0's, which also holds the rollout engine: weights, gradients and optimizer
        state count N / t there (activations are counted whole: an upper bound), the host holds every rank's
        offloaded state. rollout_bytes: what the rollout engine takes, where its options fix it (else its
        weights, KV cache and ROLLOUT_OVERHEAD).
    Raises:
        InputError: no fraction fits the GPU (the weights, gradients and activations alone are too large),
            or the fraction needed does not fit the host's memory; the message gives both estimates.
    """
    n = parameter_count(spec)
    tokens = min(micro_batch, sequences) * seq_len
    per_layer = (
        seq_len
        * min(micro_batch, sequences)
        * spec.hidden_size
        * (34 + 5 * spec.num_heads * seq_len / spec.hidden_size)
    )
    activations = spec.num_layers * per_layer + 12 * tokens * spec.vocab_size
    shard = n / tensor_parallel
    trainer = (8 if reference else 6) * shard
    rollout = rollout_bytes if rollout_bytes is not None else 2 * n + kv_cache_bytes + ROLLOUT_OVERHEAD
    fixed = trainer + activations + rollout
    budget = gpu_total * (1 - HEADROOM)
    for step in range(21):
        f = step / 20
        if fixed + optimizer_on_gpu(shard, f) <= budget:
            break
    else:
        raise InputError(
            f"{spec.name} cannot train and roll out on one GPU of {gpu_total / GB:.0f} GB: weights, "
            f"fp32 gradients, activations and the rollout engine alone need {fixed / GB:.0f} GB "
            f"(alignaudit.rl.memory); lower the micro-batch (--train-opt micro_batch_size=1) or "
            f"use a smaller model"
        )
    host_needed = f * 16 * n
    if host_needed > host_total - HOST_RESERVE:
        raise InputError(
            f"{spec.name} needs {f:.2f} of its optimizer state offloaded to fit the GPU: "
            f"{host_needed / GB:.0f} GB of host memory, and this host has {host_total / GB:.0f} GB "
            f"({HOST_RESERVE / GB:.0f} GB kept for the processes; alignaudit.rl.memory); use a "
            f"smaller model or a host with more memory"
        )
    return MemoryPlan(
        parameters=n,
        offload_fraction=f,
        gpu_total=gpu_total,
        host_total=host_total,
        trainer_weights_and_grads=trainer,
        optimizer_on_gpu=optimizer_on_gpu(shard, f),
        activations=activations,
        rollout=rollout,
        optimizer_on_host=host_needed,
    )


def optimizer_on_gpu(n: float, f: float) -> float:
    """Optimizer bytes on the GPU for ``n`` parameters with ``f`` of them offloaded (module docstring)."""
    return 12 * n if f == 0 else 16 * n * (1 - f)


def host_memory() -> int:
    """Bytes of physical memory on this host (sysconf)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rl_plan(request, group_size: int, reference: bool = False, per_step: int = 0, held=None) -> MemoryPlan | None:
    """``plan`` for ``alignaudit rl``'s request (alignaudit.inputs.request.Request): one step's sequences (``per_step``
    prompts, 0: all of them, x ``group_size``), the longest prompt; the trainer's micro-batch option ("auto":
    engines.base.micro_batches' rule) and tensor-parallel size; the rollout engine's KV cache as
    engines/vllm/adapter.py sizes it, for a step's rollout or the held-out evaluation (``held``: a
    rl.evaluation.HeldOut, one completion per prompt), whichever is larger, or as its options set it
    (kv_cache_memory_bytes; gpu_memory_utilization alone: vLLM takes that fraction of the GPU for itself). None when
    the trainer does not run on CUDA (the CPU path has no GPU to fit).

    Raises:
        InputError: as ``plan``; an option that is not a number; an hf trainer that would need offloading (only
            megatron.core offers it).
    """
    import torch

    from alignaudit.engines import kind_of
    from alignaudit.engines.base import AUTO_BATCH_ROWS, AUTO_BATCH_TOKENS, micro_batch_option
    from alignaudit.engines.checks import tensor_parallel_size
    from alignaudit.engines.vllm.adapter import kv_cache_bytes

    if request.train.settings.device != "cuda" or not torch.cuda.is_available():
        return None
    spec = request.spec
    prompts = request.batch.sequences
    sequences = (per_step or len(prompts)) * group_size
    seq_len = max(len(p) for p in prompts) + request.rollout.max_new_tokens
    held_tokens = 0
    if held is not None:
        lengths = [len(p) + request.rollout.max_new_tokens for p in held.batch.sequences]
        seq_len, held_tokens = max(seq_len, max(lengths)), sum(lengths)
    option = micro_batch_option(request.train.settings.options)
    micro = option if isinstance(option, int) else min(AUTO_BATCH_ROWS, max(1, AUTO_BATCH_TOKENS // seq_len))
    tp = tensor_parallel_size(request.train)
    infer = request.infer.settings.options
    total = torch.cuda.get_device_properties(0).total_memory
    tokens = max(sequences * seq_len, held_tokens)  # a step's rollout, or the held-out evaluation
    kv = (
        _number(infer, "kv_cache_memory_bytes")
        if "kv_cache_memory_bytes" in infer
        else kv_cache_bytes(spec, request.infer.settings.dtype, tokens, seq_len, infer)
    )
    rollout = None
    if "gpu_memory_utilization" in infer and "kv_cache_memory_bytes" not in infer:
        rollout = _number(infer, "gpu_memory_utilization") * total
    chosen = plan(spec, sequences, seq_len, micro, kv, total, host_memory(), reference, tp, rollout)
    if chosen.offload_fraction and not kind_of(request.train.engine).offloads_optimizer:
        raise InputError(
            f"{spec.name} with an {request.train.engine} trainer does not fit one GPU "
            f"({chosen.gpu_needed / GB:.0f} GB estimated without offload; alignaudit.rl.memory); "
            f"train with --train megatron, whose optimizer can keep part of its state on the host"
        )
    return chosen


def _number(options: dict, key: str) -> float:
    try:
        return float(options[key])
    except (TypeError, ValueError):
        raise InputError(f"--infer-opt {key}={options[key]!r}: not a number") from None
