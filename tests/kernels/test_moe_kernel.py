"""Strict kernels, the strict MoE layer: a token's bits independent of the batch, the capturable dispatches
(grouped, every expert) equal to the gathered one, the grouped dispatch's plan, tie-breaking.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import pytest
import torch

import alignaudit_kernels as K
from alignaudit_kernels import grouped_linear, moe
from alignaudit_kernels.grouped_linear import plan_experts
from helpers import (
    INTERPRET,
    assert_bitwise_equal,
    assert_within,
    gen,
    needs_hardware_dot,
    randn,
    ulp_of,
)


def moe_weights(e, h, i, dtype, device, seed):
    router = randn(e, h, dtype=dtype, device=device, seed=seed, scale=h**-0.5)
    gate_up = randn(e, 2 * i, h, dtype=dtype, device=device, seed=seed + 1, scale=h**-0.5)
    down = randn(e, h, i, dtype=dtype, device=device, seed=seed + 2, scale=i**-0.5)
    return router, gate_up, down


@needs_hardware_dot
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_token_bits_do_not_depend_on_the_batch(device, dtype, normalize):
    """A token alone, in a batch, and in a shuffled batch (other tokens sharing its experts in other rows)
    gets the same experts and the same bits; the layer is within bf16 rounding of the fp64 reference."""
    e, h, i, k, t = 8, 64, 32, 2, 40
    router, gate_up, down = moe_weights(e, h, i, dtype, device, seed=31)
    x = randn(t, h, dtype=dtype, device=device, seed=34)
    full, logits, chosen = K.mixture_of_experts(x, router, gate_up, down, k, normalize)
    assert logits.dtype == torch.float32 and chosen.shape == (t, k) and full.dtype == dtype
    for idx in (0, 17, t - 1):
        one, _, mine = K.mixture_of_experts(x[idx : idx + 1], router, gate_up, down, k, normalize)
        assert_bitwise_equal(f"token {idx} alone", one[0], full[idx])
        assert torch.equal(mine[0], chosen[idx])
    perm = torch.randperm(t, generator=gen(35)).to(device)
    shuffled, _, _ = K.mixture_of_experts(x[perm], router, gate_up, down, k, normalize)
    assert_bitwise_equal("shuffled batch", shuffled[torch.argsort(perm)], full)
    ref = moe.reference(x.double(), router.double(), gate_up.double(), down.double(), k, normalize)
    assert_within("moe", full, ref, 8 * ulp_of(ref, dtype) + 0.02 * ref.abs().max())


def skewed_routing(t, e, device, seed):
    """Top-2: three quarters of the tokens send slot 0 to expert 0 (several row tiles), no token picks expert 1,
    the other slots spread over experts 2..e-1 (a few rows each); a token's two experts differ. Random weights."""
    first = [0 if j < 3 * t // 4 else 2 + j % (e - 2) for j in range(t)]
    second = [2 + (j + (2 + j % (e - 2) == f)) % (e - 2) for j, f in enumerate(first)]
    chosen = torch.tensor([first, second]).T.contiguous()
    return chosen.to(device), torch.rand(t, 2, generator=gen(seed)).to(device)


def test_expert_plan_sorts_pairs_by_expert_and_owns_each_tile(device):
    """The plan of a known routing: pairs in expert order (stable), each expert's rows, and every row tile
    owned by one expert; the launched tile count depends on shapes alone, the surplus tiles owned by none."""
    chosen = torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2], [3, 0]], device=device)
    plan = plan_experts(chosen, num_experts=5, block_m=2)
    assert plan.pair.tolist() == [1, 2, 6, 9, 0, 4, 7, 3, 5, 8]  # expert 0: pairs 1, 2, 6, 9; 2: 0, 4, 7; 3: 3, 5, 8
    assert plan.token.tolist() == [0, 1, 3, 4, 0, 2, 3, 1, 2, 4]
    assert plan.starts.tolist() == [0, 4, 4, 7, 10, 10]
    assert plan.tiles == grouped_linear.tile_bound(10, 5, 2) == 7  # used: 2 + 2 + 2 = 6
    assert plan.tile_expert.tolist() == [0, 0, 2, 2, 3, 3, 5]
    assert plan.tile_row.tolist()[:6] == [0, 2, 4, 6, 7, 9]
    with pytest.raises(ValueError, match="block_m a power of two"):
        plan_experts(chosen, num_experts=5, block_m=3)
    for pairs, experts, block in ((1, 128, 16), (64, 128, 16), (4096, 8, 64), (7, 3, 1)):
        worst = torch.zeros(pairs, 1, dtype=torch.int64)
        worst[: min(experts, pairs), 0] = torch.arange(min(experts, pairs))  # as many experts as possible, uneven
        used = int(((plan_experts(worst, experts, block).starts.diff() + block - 1) // block).sum())
        assert used <= grouped_linear.tile_bound(pairs, experts, block)


def test_one_launch_plan_equals_the_torch_plan(device):
    """plan_experts_triton gives plan_experts' every field for ids in [0, E): the known routing above, a skewed one
    (an expert spanning several tiles, an empty one), random top-8 routings over 128 experts across the kernel's
    1024-pair chunks, E not a power of two, tiles of 1 to 64 rows, no tokens. Ids outside [0, E) go after starts[E],
    in pair order, never covered by a tile."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("plan_experts_triton is a Triton kernel")
    fields = ("pair", "token", "starts", "tile_expert", "tile_row")
    routings = [
        (torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2], [3, 0]]), 5, 2),
        (skewed_routing(180, 6, "cpu", seed=56)[0], 6, 64),
        (torch.zeros(0, 8, dtype=torch.int64), 128, 16),
    ]
    for t, block in ((3, 16), (150, 64), (300, 16)):
        routings.append((torch.randint(0, 128, (t, 8), generator=gen(t)), 128, block))
    routings.append((torch.randint(0, 7, (40, 3), generator=gen(9)), 7, 1))
    for chosen, experts, block in routings:
        chosen = chosen.to(device)
        want, got = plan_experts(chosen, experts, block), grouped_linear.plan_experts_triton(chosen, experts, block)
        assert (got.block_m, got.tiles, got.top_k) == (want.block_m, want.tiles, want.top_k)
        for name in fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), (tuple(chosen.shape), experts, block, name)
    chosen = torch.tensor([[1, -1], [4, 0], [1, 9]], device=device)  # -1, 4 and 9 outside [0, 4)
    plan = grouped_linear.plan_experts_triton(chosen, 4, 2)
    assert plan.starts.tolist() == [0, 1, 3, 3, 3]
    assert plan.pair.tolist() == [3, 0, 4, 1, 2, 5]  # expert 0; expert 1 (pairs 0, 4); then -1, 4, 9 in pair order
    assert plan.tile_expert.tolist()[:2] == [0, 1] and set(plan.tile_expert.tolist()[2:]) == {4}
    with pytest.raises(ValueError, match="block_m a power of two"):
        grouped_linear.plan_experts_triton(chosen, 4, 3)


@pytest.mark.parametrize("dispatch", ["grouped", "every_expert"])
def test_moe_dispatches_give_the_gathered_bits(device, dtype, dispatch, monkeypatch):
    """Every dispatch gives the gathered path's bits, on a routing where one expert spans several row tiles,
    one has no tokens and the rest a few. Neither capturable dispatch reads the routing on the host.
    Under the interpreter the rows and columns sit at the same places in their tiles as in the gathered
    path's per-expert products (64-row tiles, I = 64), because its numpy dot depends on the place."""
    if dispatch == "grouped" and device == "cpu" and not INTERPRET:
        pytest.skip("the grouped dispatch is a Triton kernel (refused on the CPU backend: the test below)")
    if dispatch == "every_expert" and INTERPRET:
        pytest.skip("every_expert computes each token at its batch row: a place-dependent numpy dot differs")
    e, h, i, t = 6, 64, 64, 180  # top-2
    _, gate_up, down = moe_weights(e, h, i, dtype, device, seed=51)
    x = randn(t, h, dtype=dtype, device=device, seed=54)
    chosen, weights = skewed_routing(t, e, device, seed=56)
    gathered = moe.combine_experts(x, chosen, weights, gate_up, down, dispatch="gathered")
    with monkeypatch.context() as m:  # no host read of the routing
        for owner, name in (
            (torch, "unique"),
            (torch.Tensor, "tolist"),
            (torch.Tensor, "nonzero"),
            (torch.Tensor, "item"),
        ):
            m.setattr(owner, name, lambda *a, _n=name, **kw: pytest.fail(f"{dispatch} read the routing: {_n}"))
        other = moe.combine_experts(x, chosen, weights, gate_up, down, dispatch=dispatch)
    assert_bitwise_equal(dispatch, other, gathered)
    per_expert = moe.combine_experts(x, chosen, weights, list(gate_up), list(down), dispatch=dispatch)
    assert_bitwise_equal(f"{dispatch}, Megatron's per-expert weights", per_expert, gathered)
    if device == "cuda":  # tiles are free there: an unaligned shape too
        args = (x[:37], chosen[:37], weights[:37], *moe_weights(e, h, 48, dtype, device, seed=57)[1:])
        assert_bitwise_equal(
            f"{dispatch}, I 48",
            moe.combine_experts(*args, dispatch=dispatch),
            moe.combine_experts(*args, dispatch="gathered"),
        )
    if device == "cuda" and dispatch == "grouped" and dtype != torch.float32:  # bench/moe_gpu.py --tiles' candidates
        default = moe._grouped(x, chosen, gate_up, down)
        for tile in grouped_linear.SWEEP_TILES:
            assert_bitwise_equal(f"grouped at tile {tile}", moe._grouped(x, chosen, gate_up, down, tile=tile), default)


def test_weighted_sum_launch_gives_the_torch_combines_bits(device, dtype):
    """The combine's one Triton launch gives ``weighted_sum``'s bits (the same fp32 products and sums in slot
    order, rounded once), at top_k 8 over rows whose magnitudes span 2^-12..2^9 and 1100 columns (across the
    launch's 1024-column block): data on which summing the slots in reverse order changes the bits (checked).
    Where a gradient is recorded, combine takes weighted_sum itself: the weights get their gradient."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the one-launch combine is a Triton kernel (the CPU backend runs weighted_sum itself)")
    t, k, h = 37, 8, 1100
    scale = (2.0 ** torch.arange(-12, 13, 3.0))[:k, None]
    y = (randn(t, k, h, dtype=torch.float32, device="cpu", seed=71) * scale).to(dtype).to(device)
    w = torch.rand(t, k, generator=gen(72)).to(device)
    want = moe.weighted_sum(y, w)
    assert want.dtype == dtype and want.shape == (t, h)
    assert_bitwise_equal("one-launch combine", moe._weighted_sum_triton(y, w), want)
    assert not torch.equal(moe.weighted_sum(y.flip(1), w.flip(1)), want), "the data cannot tell the slot order"
    assert moe._weighted_sum_triton(y[:0], w[:0]).shape == (0, h)
    assert_bitwise_equal("combine, no gradient", moe.combine(y, w), want)
    leaf = w.clone().requires_grad_()
    out = moe.combine(y, leaf)
    assert out.requires_grad
    out.float().sum().backward()
    torch.testing.assert_close(leaf.grad, y.float().sum(-1), rtol=1e-5, atol=1e-3)  # d(sum out) / dw_r = sum_h y_r
    with pytest.raises(ValueError, match="routing weights in torch.float64; route"):
        moe.combine_experts(y[:, 0], torch.zeros(t, k, dtype=torch.long, device=device), w.double(), y, y)


def test_grouped_dispatch_marks_what_it_cannot_place(device):
    """Without a host read the grouped dispatch cannot refuse an expert id outside [0, E) as the gathered one does
    (IndexError): that token's output is NaN, the others' are as gathered. Rows that do not match the plan are
    refused. A product stored in pair order (scatter) equals the sorted one moved by index_copy."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the grouped dispatch is a Triton kernel")
    _, gate_up, down = moe_weights(3, 64, 64, torch.float32, device, seed=61)
    x = randn(4, 64, dtype=torch.float32, device=device, seed=62)
    chosen = torch.tensor([[0, 3], [1, 2], [2, 0], [-1, 1]], device=device)
    weights = torch.full((4, 2), 0.5, device=device)
    with pytest.raises(IndexError, match="expert id -1 outside"):
        moe.combine_experts(x, chosen, weights, gate_up, down, dispatch="gathered")
    out = moe.combine_experts(x, chosen, weights, gate_up, down, dispatch="grouped")
    assert out[[0, 3]].isnan().all() and not out[[1, 2]].isnan().any()
    good = chosen[1:3]
    assert_bitwise_equal(
        "placeable tokens",
        out[1:3],
        moe.combine_experts(x[1:3], good, weights[1:3], gate_up, down, dispatch="gathered"),
    )
    whole = plan_experts(chosen.clamp(max=2), 3, 64)  # -1 still outside: its pair's row is NaN either way
    in_sorted_order = grouped_linear.grouped_linear(x, gate_up, whole, gather=True)
    moved = torch.empty_like(in_sorted_order).index_copy_(0, whole.pair, in_sorted_order)
    scattered = grouped_linear.grouped_linear(x, gate_up, whole, gather=True, scatter=True)
    assert torch.equal(scattered.isnan(), moved.isnan()) and bool(scattered.isnan().any())
    assert_bitwise_equal("scatter = index_copy", scattered.nan_to_num(), moved.nan_to_num())
    plan = plan_experts(good, 3, 64)
    with pytest.raises(ValueError, match="x has 4 rows for a plan of 4 pairs"):
        grouped_linear.grouped_linear(x, gate_up, plan, gather=True)
    with pytest.raises(ValueError, match="a tile of 16 rows for a plan of 64-row tiles"):
        grouped_linear.grouped_linear(x[1:3], gate_up, plan, gather=True, tile=(16, 32, 128, 4, 3))


@pytest.mark.parametrize("dispatch", ["grouped", "every_expert"])
def test_moe_capturable_dispatch_in_a_cuda_graph(device, dtype, dispatch):
    """On CUDA a captured graph of the whole layer, replayed on new tokens, gives the eager layer's bits."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    e, h, i, k, t = 8, 64, 32, 2, 24
    router, gate_up, down = moe_weights(e, h, i, dtype, device, seed=51)
    static = randn(t, h, dtype=dtype, device=device, seed=54)

    def layer(x):
        _, chosen, weights = moe.route(x, router, k, True)
        return moe.combine_experts(x, chosen, weights, gate_up, down, dispatch=dispatch)

    layer(static)  # warm-up: Triton compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(static)
    fresh = randn(t, h, dtype=dtype, device=device, seed=55)
    static.copy_(fresh)
    graph.replay()
    assert_bitwise_equal("graph replay", captured, K.mixture_of_experts(fresh, router, gate_up, down, k, True)[0])


def test_moe_dispatch_choice_and_refusals(device, monkeypatch):
    """The default dispatch is the grouped one on the Triton backends, the gathered one on the CPU backend;
    ALIGNAUDIT_MOE_DISPATCH picks another and a wrong value is refused by name; the grouped dispatch refuses the CPU
    backend."""
    x = torch.zeros(2, 8, device=device)
    assert moe.dispatch_for(x) == ("grouped" if INTERPRET or device == "cuda" else "gathered")
    monkeypatch.setenv("ALIGNAUDIT_MOE_DISPATCH", "grouped")
    assert moe.dispatch_for(x) == "grouped"
    monkeypatch.setenv("ALIGNAUDIT_MOE_DISPATCH", "fused")
    with pytest.raises(ValueError, match="ALIGNAUDIT_MOE_DISPATCH=.fused.: use one of auto, gathered, grouped"):
        moe.dispatch_for(x)
    monkeypatch.delenv("ALIGNAUDIT_MOE_DISPATCH")
    _, gate_up, down = moe_weights(4, 8, 8, torch.float32, device, seed=1)
    chosen, weights = torch.tensor([[0], [3]], device=device), torch.ones(2, 1, device=device)
    with pytest.raises(ValueError, match="dispatch 'fused': use one of gathered, grouped, every_expert"):
        moe.combine_experts(x, chosen, weights, gate_up, down, dispatch="fused")
    if device == "cpu" and not INTERPRET:
        with pytest.raises(ValueError, match="grouped MoE dispatch needs the Triton backend"):
            moe.combine_experts(x, chosen, weights, gate_up, down, dispatch="grouped")


def test_moe_ties_go_to_the_lower_expert_and_weights_are_probabilities(device):
    """Experts 2 and 5 with identical router rows tie for the largest logit: both are chosen, 2 first;
    torch.topk does not specify an order for ties."""
    e, h, i = 8, 32, 16
    router, gate_up, down = moe_weights(e, h, i, torch.float32, device, seed=41)
    x = randn(6, h, dtype=torch.float32, device=device, seed=44)
    router[2] = router[5] = x[0] * 4  # the largest logit for token 0, twice
    _, logits, chosen = K.mixture_of_experts(x, router, gate_up, down, 2, True)
    assert logits[0, 2] == logits[0, 5] and chosen[0].tolist() == [2, 5]
    _, weights_normalized = moe.route(x, router, 2, True)[1:]
    assert torch.allclose(weights_normalized.sum(-1).cpu(), torch.ones(6), rtol=0, atol=2**-22)
    assert weights_normalized[0, 0] == weights_normalized[0, 1] == 0.5
    _, _, weights_plain = moe.route(x, router, 2, False)
    full_softmax = torch.softmax(logits.double(), -1).gather(1, chosen)
    assert torch.allclose(weights_plain.double(), full_softmax, rtol=0, atol=1e-6)
    assert bool((weights_plain.sum(-1) < 0.99).any())  # without renormalization the other experts keep their share
    with pytest.raises(ValueError, match="top_k 9 outside"):
        moe.route(x, router, 9, True)
