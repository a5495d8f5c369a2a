"""The mismatch metrics of one RL step's logprobs, as compare computes them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import torch

from alignaudit.api.checks import check_number
from alignaudit.errors import InputError

if TYPE_CHECKING:
    from alignaudit.comparison.summary import TokenSummary


def mismatch_metrics(
    train_logprobs, rollout_logprobs, mask: torch.Tensor | None = None, clip_eps: float = 0.2
) -> TokenSummary:
    """The mismatch metrics of one RL step, computed as ``compare`` computes them (summary.json's fields:
    tokens_compared, mismatches, mismatch_fraction, ulp_max, ulp_histogram, max_abs_diff, NaN/Inf counts and
    ``rl``: importance-ratio range, clip fraction at ``clip_eps``, token_mult_prob_error, probability
    differences, K3 KL; docs/output.md has each formula).

    Args:
        train_logprobs, rollout_logprobs: the trainer's and the rollout engine's logprobs of the same tokens:
            two lists of 1-D tensors (one per sequence, equal lengths pairwise), or two [B, T] tensors with
            ``mask`` [B, T] (bool, True = a token to compare, e.g. the response mask).
        clip_eps: the PPO clip range the clip fraction counts against.
    Raises:
        InputError: shapes or lengths that disagree, no token to compare, or a compared value above 0 (+inf
            included: alignaudit.inputs.values.check_logprob_signs).
    """
    from alignaudit.comparison.token_diff import compare_tokens, summarize_tokens
    from alignaudit.inputs.values import check_logprob_signs
    from alignaudit.pipelines.requests import check_clip_eps

    check_number("clip_eps", clip_eps, "a number in (0, 1)")
    check_clip_eps(clip_eps)
    train, rollout = _rows(train_logprobs, mask, "train_logprobs"), _rows(rollout_logprobs, mask, "rollout_logprobs")
    if len(train) != len(rollout) or any(a.shape != b.shape for a, b in zip(train, rollout, strict=True)):
        raise InputError(
            f"train_logprobs and rollout_logprobs disagree: {[len(a) for a in train]} tokens per "
            f"sequence vs {[len(b) for b in rollout]}"
        )
    for name, rows in (("train_logprobs", train), ("rollout_logprobs", rollout)):
        check_logprob_signs(name, rows, [f"sequence {i}" for i in range(len(rows))])
    seq = [torch.full((len(a),), i) for i, a in enumerate(train)]
    tokens = pd.DataFrame(
        {
            "seq": torch.cat(seq).numpy() if seq else [],
            "pos": torch.cat([torch.arange(len(a)) for a in train]).numpy() if train else [],
            "lp_train": torch.cat(train).numpy() if train else [],
            "lp_infer": torch.cat(rollout).numpy() if rollout else [],
        }
    )
    return summarize_tokens(compare_tokens(tokens), clip_eps)


def _rows(logprobs, mask, name: str) -> list[torch.Tensor]:
    """One fp32 CPU tensor per sequence from a list of 1-D tensors or a [B, T] tensor with ``mask``; each checked by
    ``_fp32``."""
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.is_meta):
        raise InputError(
            f"mask must be a bool tensor (True = a token to compare), not {getattr(mask, 'dtype', type(mask).__name__)}"
        )
    if isinstance(logprobs, torch.Tensor):
        if logprobs.dim() != 2:
            raise InputError(
                f"{name}: a [B, T] tensor (with mask) or a list of 1-D tensors, not shape {tuple(logprobs.shape)}"
            )
        if mask is None:
            mask = torch.ones_like(logprobs, dtype=torch.bool)
        if mask.shape != logprobs.shape:
            raise InputError(f"mask {tuple(mask.shape)} and {name} {tuple(logprobs.shape)} differ in shape")
        values = _fp32(logprobs, name)
        return [row[m] for row, m in zip(values, mask.cpu(), strict=True)]
    if mask is not None:
        raise InputError(f"mask applies to [B, T] tensors; {name} is a list of sequences")
    if isinstance(logprobs, (str, bytes)) or not isinstance(logprobs, (list, tuple)):
        raise InputError(
            f"{name}: a list of 1-D tensors (one per sequence) or a [B, T] tensor, not {type(logprobs).__name__}"
        )
    rows = []
    for i, row in enumerate(logprobs):
        if isinstance(row, (str, bytes)):
            raise InputError(f"{name}[{i}] is text; give numbers")
        try:
            # Python floats are float64: kept as such, so _fp32 refuses what fp32 would round
            tensor = row if isinstance(row, torch.Tensor) else torch.as_tensor(row, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"{name}[{i}]: not a sequence of numbers ({str(e).splitlines()[0]})") from None
        if tensor.dim() != 1:
            raise InputError(f"{name}: each sequence's logprobs must be 1-D; give a [B, T] tensor with a mask instead")
        rows.append(_fp32(tensor, f"{name}[{i}]"))
    return rows


def _fp32(values: torch.Tensor, name: str) -> torch.Tensor:
    """``values`` as fp32 on the CPU, refusing what fp32 would change: alignaudit compares fp32 bit patterns (what
    engines record), into which bf16 and fp16 convert exactly; float64 only where every value converts exactly.

    Raises:
        InputError: a meta tensor, a non-floating dtype (int, bool, complex), or float64 values fp32 cannot hold.
    """
    if values.is_meta:
        raise InputError(f"{name} is a meta tensor (no values); give the logprobs themselves")
    if not values.is_floating_point():
        raise InputError(f"{name} has dtype {values.dtype}; logprobs are floating point (fp32 as engines record them)")
    values = values.detach().cpu()
    converted = values.float()
    if values.dtype == torch.float64:
        same = (converted.double() == values) | (values.isnan() & converted.isnan())
        if not bool(same.all()):
            raise InputError(
                f"{name} holds float64 logprobs that fp32 cannot hold exactly; alignaudit compares the "
                "fp32 values engines record: pass those (or .float() both sides yourself, knowing it "
                "rounds)"
            )
    return converted
