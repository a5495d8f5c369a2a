"""The algorithm's fixed sizes and choices (the package docstring: alignaudit_kernels.attention)."""

from __future__ import annotations

import torch

from alignaudit_kernels.primitives import (
    use_triton,
)

BLOCK_N = 64


CHUNK_N = 512


TILE_ROWS = 64


EXP_CHOICES = ("portable", "native")


DEFAULT_EXP = "portable"


def _check_exp(exp: str, q: torch.Tensor) -> None:
    if exp not in EXP_CHOICES:
        raise ValueError(f"exp must be one of {', '.join(EXP_CHOICES)}, not {exp!r}")
    if exp == "native" and not use_triton(q):
        raise ValueError("exp='native' is a GPU instruction; the CPU backend computes the portable exp only")
