"""The strict forward under torch.compile: every strict op enters the graph as an opaque custom op, so HF's
strict forward compiles to one graph without breaks and returns the eager strict bits."""

from __future__ import annotations

import torch
import torch._dynamo
from transformers import AutoModelForCausalLM

import alignaudit_kernels as K
from alignaudit.strict import STRICT_OPS
from alignaudit.strict.hf import make_strict
from conftest import FIXTURE, assert_bitwise_equal


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
