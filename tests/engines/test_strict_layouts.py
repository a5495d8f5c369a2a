"""The strict modules users build into their trainers refuse the batch layouts they do not compute.

Tried as a user would: a left-padded batch (key-padding mask, positions shifted by the padding) fed to
StrictGPTModel gave wrong logprobs for every token of the padded sequences (55 of 87, max |d| 9.91), with no
warning, because strict attention attends causally over whole sequences and strict rope rotates index i by
position i. Now each argument it would not honour raises a ValueError naming it; the layout it computes
(right padding, causal mask, positions 0..s-1) keeps working. Real megatron-core on the fixture, in a
subprocess (Megatron keeps process-global parallel state), and transformers' model with the HF strict swap.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import FIXTURE

pytestmark = pytest.mark.engines

SCRIPT = """
import sys, torch
from alignaudit.engines import load_engine_class
from alignaudit.inputs.request import EngineSettings
from alignaudit.inputs.checkpoint import load_spec

engine = load_engine_class("megatron")(load_spec(sys.argv[1]), EngineSettings("bf16", "cpu", 0, {}, strict="all"))
ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
positions = torch.arange(12).expand(2, 12)
causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
left_padded = positions.clone()
left_padded[1] = (torch.arange(12) - 3).clamp(min=0)
padding_mask = causal.expand(2, 1, 12, 12).clone()
padding_mask[1, :, :, :3] = True
with torch.no_grad():
    assert engine.gpt(ids, positions, causal).shape[:2] == (2, 12)
    assert engine.gpt(ids, None, None).shape[:2] == (2, 12)
    for pos, mask, name in ((left_padded, causal, "position_ids"), (positions, padding_mask, "attention_mask"),
                            (positions, causal.float(), "attention_mask")):
        try:
            engine.gpt(ids, pos, mask)
        except ValueError as e:
            assert str(e).startswith(f"StrictGPTModel: {name} must be"), e
        else:
            raise AssertionError(f"{name}: a layout strict attention does not compute was accepted")
print("refused both")
"""


def test_strict_gpt_model_refuses_left_padded_batches():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(FIXTURE)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "refused both" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_hf_strict_attention_refuses_left_padding_and_keeps_right_padding():
    """The same contract in the HF strict swap: right padding (the HF engine's own batches) gives each
    sequence the bits of it alone; a left-padded batch (positions shifted, pads masked at the start) raises."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM

    from alignaudit.engines.hf.strict import make_strict
    from alignaudit.inputs.strict_ops import STRICT_OPS

    model = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.bfloat16).eval()
    make_strict(model, frozenset(STRICT_OPS))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, 12, dtype=torch.long)
    valid[1, 9:] = 0
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=valid).logits
        alone = model(input_ids=ids[1:, :9]).logits
        assert torch.equal(batch[1, :9].view(torch.int16), alone[0].view(torch.int16))
        left = torch.ones(2, 12, dtype=torch.long)
        left[1, :3] = 0
        positions = (left.cumsum(1) - 1).clamp(min=0)
        with pytest.raises(ValueError, match="position_ids must be each token's index"):
            model(input_ids=ids, attention_mask=left, position_ids=positions)
        with pytest.raises(ValueError, match="attention_mask must be causal with padding only at the end"):
            model(input_ids=ids, attention_mask=left)
