"""The strict forward under torch.compile and without host reads: every strict op enters the graph as an
opaque custom op, so HF's strict forward compiles to one graph without breaks and returns the eager strict
bits; rope takes the caller's sequence bound instead of reading positions on the host."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM

import alignaudit_kernels as K
from alignaudit.engines.hf.strict import make_strict
from alignaudit.inputs.strict_ops import STRICT_OPS
from helpers import FIXTURE, assert_bitwise_equal


def test_hf_strict_forward_compiles_to_one_graph_with_the_eager_bits():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16).eval()
    make_strict(model, frozenset(STRICT_OPS))
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def logprobs():
        return K.token_logprobs(model(ids).logits[:, :-1], ids[:, 1:])

    eager = logprobs()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(logprobs)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    assert_bitwise_equal("compiled strict logprobs", torch.compile(logprobs, backend="aot_eager")(), eager)


def test_rope_with_a_host_bound_gives_the_same_bits_and_refuses_positions_past_its_tables():
    """RopeOp with the caller's sequence bound (no host read of positions, what the engines pass) rotates
    like RopeOp without one; a position past the tables is refused on the CPU instead of read past them
    (on a GPU it gives NaN rows: tests/kernels/test_rope.py)."""
    from alignaudit.engines.custom_ops import rotate
    from alignaudit.engines.strict_modules import RopeOp

    rope = RopeOp(16, 1e4, max_positions=8)
    x = torch.randn(2, 20, 4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    positions = torch.arange(20)[None].expand(2, 20)
    assert_bitwise_equal("bounded rope", rope(x, positions, limit=20), rope(x, positions))
    with pytest.raises(IndexError, match="positions 1010..1029 outside the 1024 rows of the rope tables"):
        rotate(x[0], torch.arange(1010, 1030), 1e4, 19, [])  # tables of 19 positions hold 1024 (TABLE_ROWS)


def test_compiled_rope_keeps_its_gradient():
    """Traced with gradients, RopeOp stays on the autograd path (the opaque rope op is forward only), and
    its cos/sin tables are still built eagerly: Dynamo never traces rope_tables (a compiled torch.cos could
    round otherwise; Dynamo says so when it traces through an lru_cache)."""
    from alignaudit.engines.strict_modules import RopeOp

    rope = RopeOp(16, 1e4, max_positions=8)
    x = torch.randn(1, 6, 2, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    positions = torch.arange(6)[None]
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(lambda x: rope(x, positions, 6).square().sum(), backend="aot_eager")(x).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def _gradient_cases():
    """Each strict op with an autograd path, on fp32 CPU tensors (a no-op output cast is where torch 2.11's compiled
    autograd.Function lost the gradient): (name, fn, input shapes)."""
    positions = torch.arange(6)
    cos, sin = K.rope_tables(8, 16, 1e4, "cpu")
    return [
        ("linear", lambda x, w: K.linear(x, w), [(5, 16), (8, 16)]),
        ("linear, 4 K segments", lambda x, w: K.linear(x, w, None, 4), [(5, 16), (8, 16)]),
        ("rms_norm", lambda x, w: K.rms_norm(x, w, 1e-6), [(5, 16), (16,)]),
        ("rms_norm with residual", lambda x, w: K.rms_norm(x, w, 1e-6, residual=x * 0.5)[0], [(5, 16), (16,)]),
        ("silu_mul", K.silu_mul, [(5, 16), (5, 16)]),
        ("apply_rope", lambda x: K.apply_rope(x, positions, cos, sin), [(6, 2, 16)]),
        ("log_softmax", K.log_softmax, [(5, 32)]),
        ("token_logprobs", lambda x: K.token_logprobs(x, torch.arange(5)), [(5, 32)]),
        ("causal_attention", lambda q, k, v: K.causal_attention(q, k, v, positions[None], 0.25), [(1, 6, 2, 16)] * 3),
    ]


GRADIENT_CASES = _gradient_cases()


@pytest.mark.parametrize("name, fn, shapes", GRADIENT_CASES, ids=[case[0] for case in GRADIENT_CASES])
def test_compiled_strict_ops_give_the_eager_gradients(name, fn, shapes):
    """Traced with gradients, each strict op keeps its autograd path: the compiled backward gives the eager
    gradients bit for bit, and none is all zero (torch 2.11 gave apply_rope's fp32 CPU path an all-zero gradient
    while its forward ended in a no-op ``.to(x.dtype)``; docs/log/gpu-sessions.md 2026-12-04)."""
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(*shape, generator=generator) for shape in shapes]
    grads = []
    for compiled in (False, True):
        leaves = [x.clone().requires_grad_() for x in inputs]
        torch._dynamo.reset()
        out = (torch.compile(fn, backend="aot_eager") if compiled else fn)(*leaves)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads.append([x.grad for x in leaves])
    for i, (eager, compiled) in enumerate(zip(*grads, strict=True)):
        assert eager.abs().sum() > 0
        assert_bitwise_equal(f"{name}: compiled gradient of input {i}", compiled, eager)


def _opaque_op_cases():
    """(op, arguments) for every opaque op a compiled engine calls, on small CPU inputs."""
    from alignaudit.engines import custom_ops

    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16

    def rand(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype)

    ops = torch.ops.alignaudit_kernels
    cos, sin = K.rope_tables(16, 8, 1e4, "cpu")
    return {
        "linear": (ops.linear.default, (rand(3, 8), rand(5, 8), None, 1)),
        "rms_norm": (ops.rms_norm.default, (rand(3, 8), rand(8), 1e-6)),
        "add_rms_norm": (ops.add_rms_norm.default, (rand(3, 8), rand(8), 1e-6, rand(3, 8))),
        "apply_rope": (ops.apply_rope.default, (rand(3, 2, 8), torch.arange(3), cos, sin)),
        "apply_rope_qk": (ops.apply_rope_qk.default, (rand(3, 2, 8), rand(3, 1, 8), torch.arange(3), cos, sin)),
        "silu_mul": (ops.silu_mul.default, (rand(3, 8), rand(3, 8))),
        "log_softmax": (ops.log_softmax.default, (rand(2, 10),)),
        "token_logprobs": (ops.token_logprobs.default, (rand(2, 10), torch.tensor([1, 7]))),
        "causal_attention": (
            ops.causal_attention.default,
            (rand(1, 4, 2, 8), rand(1, 4, 1, 8), rand(1, 4, 1, 8), torch.arange(4)[None], 0.35, "portable"),
        ),
        "rope": (custom_ops.rope, (rand(3, 2, 8), torch.arange(3), 1e4, 16, [])),
        "rope_qk": (custom_ops.rope_qk, (rand(3, 2, 8), rand(3, 1, 8), torch.arange(3), 1e4, 16, [])),
        "linear_partial": (custom_ops.linear_partial, (rand(3, 8), rand(5, 8), 2)),
    }


OPAQUE_CASES = _opaque_op_cases()


def test_every_opaque_op_is_checked():
    from alignaudit_kernels.primitives import OPAQUE_OPS

    assert sorted(op.name().split("::")[1] for op in OPAQUE_OPS) == sorted(OPAQUE_CASES)


@pytest.mark.parametrize("name", sorted(OPAQUE_CASES))
def test_opaque_ops_return_fresh_tensors_and_refuse_gradients(name):
    """Each opaque op is registered by Library.define + impl (primitives.opaque_op: less host time a call than
    torch.library.custom_op, whose run-time aliasing check it gives up), so this test is that check: no output
    shares storage with an input or with another output. Called where autograd would record a gradient, the op
    refuses (it has no backward), on this backend as on every other."""
    from torch._library.custom_ops import OPDEFS

    op, args = OPAQUE_CASES[name]
    assert op.name() not in OPDEFS, f"{op.name()} is a torch.library.custom_op"
    with torch.no_grad():
        out = op(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    storages = [o.untyped_storage().data_ptr() for o in outs]
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    assert len(set(storages)) == len(storages) and not inputs & set(storages), f"{name} returned an alias"
    floating = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    tracked = [a.detach().requires_grad_() if i == floating[0] else a for i, a in enumerate(args)]
    with pytest.raises(RuntimeError, match=f"{op.name()} is forward only"):
        op(*tracked)
