"""Strict kernels, token logprobs over a vocabulary split across ranks (gloo): the whole vocabulary's bits, and the
refusals.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import math

import pytest
import torch

import alignaudit_kernels as K
from alignaudit_kernels import primitives
from helpers import (
    INTERPRET,
    assert_bitwise_equal,
    gen,
    randn,
)


def _vocab_parallel_rank(rank, world, init_file, logits, targets, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    v = logits.shape[-1] // world
    shard = logits[..., rank * v : (rank + 1) * v].clone().requires_grad_(True)
    lp = K.token_logprobs_vocab_parallel(shard, targets, rank * v, logits.shape[-1], dist.group.WORLD)
    (lp * LOSS_MASK).sum().backward()
    with torch.no_grad():
        no_grad = K.token_logprobs_vocab_parallel(shard, targets, rank * v, logits.shape[-1], dist.group.WORLD)
    torch.save((lp.detach(), no_grad, shard.grad), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


LOSS_MASK = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])  # masked tokens: their gradients are -0.0, kept bit for bit


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_logprobs_equal_the_whole_vocabulary(request, tmp_path, world):
    """Ranks holding vocabulary shards (gloo processes) all-reduce only row statistics, yet every rank gets
    token_logprobs' bits for the whole vocabulary (a NaN row stays NaN everywhere; -inf logits on one shard
    change nothing), and the shards' gradients are the whole-vocabulary gradient's columns, under a loss
    mask too (zero gradients keep their sign)."""
    if request.config.getoption("--kernel-device") == "cuda":
        pytest.skip("one process per rank on the CPU (gloo); GPU ranks run in bench/gpu_run.sh q8-tp2")
    if world == 4 and not INTERPRET:
        pytest.skip("four ranks under the interpreter only (CI time)")
    v = 4800
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    logits = randn(3, 5, v, dtype=dtype, device="cpu", seed=31, scale=4)
    logits[1, 2, v - 7] = float("nan")  # on the last rank's shard
    logits[2, 0, : v // 2] = float("-inf")  # masked logits filling the first half
    targets = torch.randint(0, v, (3, 5), generator=gen(32))
    targets[2, 0] = v - 1
    torch.multiprocessing.spawn(
        _vocab_parallel_rank, args=(world, str(tmp_path / "init"), logits, targets, str(tmp_path)), nprocs=world
    )
    whole = logits.clone().requires_grad_(True)
    expected = K.token_logprobs(whole, targets)
    (expected * LOSS_MASK).sum().backward()
    for rank in range(world):
        lp, no_grad, grad = torch.load(tmp_path / f"rank{rank}.pt")
        assert_bitwise_equal(f"rank {rank} logprobs", lp, expected.detach())
        assert_bitwise_equal(f"rank {rank} logprobs without autograd", no_grad, expected.detach())
        assert_bitwise_equal(
            f"rank {rank} gradient", grad, whole.grad[..., rank * v // world : (rank + 1) * v // world]
        )
    assert lp[1].isnan().tolist() == [False, False, True, False, False]
    assert ((whole.grad == 0) & torch.signbit(whole.grad)).any()  # -0.0 gradients were there to keep
    z = logits.float() - logits.float().amax(-1, keepdim=True)  # negative control: shards' float sums added
    shards = [primitives.fixed_sum(primitives.exp(part)) for part in z.chunk(world, -1)]
    assert not torch.equal(sum(shards[1:], shards[0]), primitives.fixed_sum(primitives.exp(z)))


def _out_of_range_rank(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    shard = torch.zeros(2, 8)
    lp = K.token_logprobs_vocab_parallel(shard, torch.tensor([3, 16]), rank * 8, 16, dist.group.WORLD)
    torch.save(lp, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_vocab_parallel_logprobs_refuse_bad_shards_and_flag_bad_targets(request, tmp_path):
    """A shard outside the vocabulary is refused before any communication; a target outside [0, V) (checked
    without a host synchronization) makes its row NaN on every rank, never -inf or a finite value."""
    if request.config.getoption("--kernel-device") == "cuda":
        pytest.skip("one process per rank on the CPU (gloo)")
    with pytest.raises(ValueError, match="does not fit a vocabulary of 16"):
        K.token_logprobs_vocab_parallel(torch.zeros(2, 8), torch.tensor([0, 1]), 12, 16, None)
    torch.multiprocessing.spawn(_out_of_range_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        lp = torch.load(tmp_path / f"rank{rank}.pt")
        assert lp[0].item() == pytest.approx(-math.log(16)) and lp[1].isnan()
