"""The trainer's replay of the rollout's sampling transform: temperature, then top-k, then top-p.

RL trainers score the rollout's tokens under the distribution the rollout sampled from: verl and NeMo-RL
divide the logits by the rollout temperature before the log-softmax, and some apply the same top-k/top-p
truncation. vLLM's ``processed_logprobs`` are that distribution's logprobs, so a trainer that replays it
computes the same quantity. The order and arithmetic follow vLLM 0.32 (CPU path), and the strict vLLM plugin
(alignaudit.engines.vllm.plugin, op "logprobs") computes processed logprobs with these same functions and the
strict log-softmax, so a trainer's replay gives vLLM's bits:
    temperature  logits.float() / T, one IEEE fp32 division per element (vllm/v1/sample/sampler.py,
                 Sampler.apply_temperature)
    top-k        logits below the k-th largest value set to -inf; ties at the k-th value are kept
                 (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_only)
    top-p        ascending sort, softmax, cumulative sum; entries whose cumulative probability is
                 <= 1 - p set to -inf, the largest always kept (apply_top_k_top_p_pytorch)
Top-p's boundary depends on how the softmax and the cumulative sum round: where a token sits exactly at
the boundary, an engine that rounds differently can keep a different set.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The trainer's replay of the sampling transform of ``logits`` [rows, V] (any float dtype), in fp32: each
    row as ``scale_by_temperature`` then ``truncate`` give it inside a strict vLLM, whatever the rows around it.

    Returns:
        fp32 tensor of the same shape: logits / temperature with the truncated entries at -inf.
    Raises:
        ValueError: temperature <= 0, top_k < 0, or top_p outside (0, 1].
    """
    if not temperature > 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"bad sampling transform: temperature={temperature}, top_k={top_k}, top_p={top_p}")
    rows = logits.reshape(-1, logits.shape[-1])

    def per_row(value, dtype):
        return torch.full((rows.shape[0],), value, dtype=dtype, device=rows.device)

    x = scale_by_temperature(rows, per_row(temperature, torch.float32))
    x = truncate(x, per_row(top_k, torch.long) if top_k else None, per_row(top_p, torch.float32) if top_p < 1 else None)
    return x.reshape(logits.shape)


def scale_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, V]: logits.float() / temperature[row], one IEEE fp32 division per element (vLLM's
    Sampler.apply_temperature: ``logits.div_(temp.unsqueeze(1))``). ``temperature``: fp32 [rows], on the logits'
    device. A tensor divisor on purpose: CUDA divides by a Python scalar as a multiply by its reciprocal
    (aten's div_true_kernel_cuda), which rounds differently."""
    return logits.float().contiguous() / temperature.to(device=logits.device, dtype=torch.float32)[:, None]


def truncate(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k, then top-p, of fp32 logits ``x`` [rows, V] (already divided by the temperature), each row on its
    own: entries dropped set to -inf, a new tensor.

    Args:
        top_k: int [rows] or None; a row's k <= 0 or >= V keeps every entry (vLLM's "disabled" values). Entries
            below the row's k-th largest value go; ties at it stay (apply_top_k_only).
        top_p: fp32 [rows] or None; a row's p >= 1 keeps every entry. The row sorted ascending (stable), softmax,
            cumulative sum; entries whose cumulative probability is <= 1 - p go, the largest always stays
            (apply_top_k_top_p_pytorch).
    Top-k is exact whatever the batch (a sort and comparisons). Top-p's boundary depends on how the softmax and
    the cumulative sum round, which depends on how many rows a call holds, so it runs one [1, V] row per
    call: the trainer's replay and the strict vLLM sampler run the same calls on the same row. On CUDA torch's
    cumsum scans a one-row tensor with CUB's device-wide scan and more rows with a row kernel whose threads per row
    depend on the row count (aten/src/ATen/native/cuda/ScanUtils.cuh, scan_dim and
    get_log_num_threads_x_inner_scan): bench/top_p_probe.py found a row alone unlike the same row in any batch of
    2-64, on an H200 and an H100 (torch 2.11, 2026-12-06; docs/log/gpu-sessions.md).
    """
    x = x.clone()
    vocab = x.shape[-1]
    if top_k is not None:
        k = top_k.to(device=x.device, dtype=torch.long)
        active = (k > 0) & (k < vocab)
        if bool(active.any()):
            ordered = x.sort(dim=-1, descending=True).values
            kth = ordered.gather(1, (k.clamp(1, vocab) - 1)[:, None])
            x = x.masked_fill(active[:, None] & (x < kth), float("-inf"))
    if top_p is not None:
        p = top_p.to(device=x.device, dtype=torch.float32)
        for row in torch.nonzero(p < 1).flatten().tolist():
            x[row] = _top_p_row(x[row : row + 1], p[row : row + 1])[0]
    return x


def _top_p_row(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """One row [1, V] of top-p (truncate's docstring)."""
    order = x.sort(dim=-1, descending=False, stable=True)
    cumulative = order.values.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p[:, None]
    drop[..., -1] = False  # at least one token
    return x.scatter(-1, order.indices, order.values.masked_fill(drop, float("-inf")))


def generated_rows(prompt_length: int, length: int) -> slice:
    """Rows of a sequence's next-token logits ([length - 1, V]) that predict generated tokens: position
    t's logits predict token t + 1, so rows prompt_length - 1 .. length - 2."""
    return slice(prompt_length - 1, length - 1)
