"""The strict modules users build into their trainers take the batch layouts trainers feed, or refuse them.

Tried as a user would: a left-padded batch (key-padding mask, positions shifted by the padding) fed to
StrictGPTModel gave wrong logprobs for every token of the padded sequences (55 of 87, max |d| 9.91), with no
warning, because strict attention attended causally over whole rows and strict rope rotated index i by
position i. StrictGPTModel now computes each row's run of unmasked tokens as one sequence, rotates at the
position_ids it is given, and computes THD packs by their cu_seqlens: every layout gives a sequence the bits
it has alone. What it does not compute raises a ValueError naming the argument. Real megatron-core on the
fixture, in a subprocess (Megatron keeps process-global parallel state), and transformers' model with the HF
strict swap (right and left padding; refusals under torch.compile).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import FIXTURE

pytestmark = pytest.mark.engines

SCRIPT = """
import copy, sys, torch
from megatron.core.packed_seq_params import PackedSeqParams
from alignaudit.engines import load_engine_class
from alignaudit.engines.megatron.strict import StrictGPTModel
from alignaudit.inputs.request import EngineSettings
from alignaudit.inputs.checkpoint import load_spec

engine = load_engine_class("megatron")(load_spec(sys.argv[1]), EngineSettings("bf16", "cpu", 0, {}, strict="all"))
gpt = engine.gpt
g = torch.Generator().manual_seed(0)
lengths = (12, 9, 5)
seqs = [torch.randint(0, 512, (n,), generator=g) for n in lengths]
b, s = len(seqs), max(lengths)
bits = lambda t: t.contiguous().view(torch.int16)

def run(ids, positions, mask, **kw):  # logits [b, s, V] and the strict logprob head's loss [b, s]
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        return gpt(ids, positions, mask, **kw), gpt(ids, positions, mask, labels=labels, **kw)

alone = [run(x[None], None, None) for x in seqs]
causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
right = torch.zeros(b, s, dtype=torch.long)
left = torch.zeros(b, s, dtype=torch.long)
right_keys = causal.expand(b, 1, s, s).clone()
left_keys = causal.expand(b, 1, s, s).clone()
left_positions = torch.zeros(b, s, dtype=torch.long)
for i, x in enumerate(seqs):
    n = len(x)
    right[i, :n] = x
    right_keys[i, :, :, n:] = True
    left[i, s - n:] = x
    left_keys[i, :, :, :s - n] = True
    left_positions[i, s - n:] = torch.arange(n)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
layouts = {
    "right-padded, causal mask": (run(right, None, causal), lambda i, n: (i, slice(0, n))),
    "right-padded, padding mask": (run(right, None, right_keys), lambda i, n: (i, slice(0, n))),
    "left-padded, padding mask and positions": (run(left, left_positions, left_keys),
                                                lambda i, n: (i, slice(s - n, s))),
    "packed (THD)": (run(torch.cat(seqs)[None], None, None, packed_seq_params=packed),
                     lambda i, n: (0, slice(int(cu[i]), int(cu[i + 1])))),
}
for name, ((logits, loss), where) in layouts.items():
    for i, n in enumerate(lengths):
        row, span = where(i, n)
        assert torch.equal(bits(logits[row, span]), bits(alone[i][0][0])), (name, i, "logits")
        last = slice(span.start, span.stop - 1)  # the last token's label wraps around within its own row
        assert torch.equal(loss[row, last].view(torch.int32), alone[i][1][0, :n - 1].view(torch.int32)), (name, i)
    print("same bits:", name)

# a THD pack's layout is read once a forward, not in every layer (each read waits for the stream on a GPU)
import alignaudit.engines.megatron.strict as strict_module
reads, read = [], strict_module.packed_cu_seqlens
strict_module.packed_cu_seqlens = lambda *args: reads.append(args) or read(*args)
run(torch.cat(seqs)[None], None, None, packed_seq_params=packed)  # two forwards: logits, then the loss
strict_module.packed_cu_seqlens = read
assert engine.config.num_layers > 1 and len(reads) == 2, (engine.config.num_layers, len(reads))
print("pack read once a forward")

# the negative control: stock Megatron (no strict ops) does not give a left-padded sequence its bits alone
stock = load_engine_class("megatron")(load_spec(sys.argv[1]), EngineSettings("bf16", "cpu", 0, {})).gpt
with torch.no_grad():
    batched, single = stock(left, left_positions, left_keys), stock(seqs[2][None], None, causal[..., :5, :5])
assert not torch.equal(bits(batched[2, s - 5:]), bits(single[0])), "stock megatron gave the same bits: no control"

def refused(call, prefix):
    try:
        call()
    except ValueError as e:
        assert str(e).startswith(prefix), e
        print("refused:", e)
    else:
        raise AssertionError(f"accepted: {prefix}")

hole = left_keys.clone()
hole[0, :, :, 3] = True
bidirectional = torch.zeros(1, 1, s, s, dtype=torch.bool)
refused(lambda: run(left, left_positions, hole), "StrictGPTModel: attention_mask must be causal over one contiguous")
refused(lambda: run(right, None, bidirectional), "StrictGPTModel: attention_mask must be causal over one contiguous")
refused(lambda: run(right, None, causal.float()), "StrictGPTModel: attention_mask must be bool")
refused(lambda: run(left, None, left_keys), "StrictGPTModel: a left-padded row needs position_ids")
refused(lambda: run(right, None, right_keys[:, :, 0]), "StrictGPTModel: attention_mask (3, 1, 12) does not broadcast")
refused(lambda: run(torch.cat(seqs)[None].expand(2, -1), None, None, packed_seq_params=packed),
        "StrictGPTModel: a THD pack is input_ids [1, tokens]")
shifted = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu * 2)
refused(lambda: run(torch.cat(seqs)[None], None, None, packed_seq_params=shifted),
        "StrictGPTModel: packed_seq_params.cu_seqlens_q_padded differs")
for name in ("context_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
    config = copy.copy(engine.config)
    setattr(config, name, 2)
    refused(lambda: StrictGPTModel(config, None), f"StrictGPTModel: {name}=2 is not supported")
config = copy.copy(engine.config)
config.sequence_parallel = True
refused(lambda: StrictGPTModel(config, None), "StrictGPTModel: sequence_parallel is not supported")
config = copy.copy(engine.config)
config.recompute_granularity = "full"
gpt.config = config
refused(lambda: run(left, left_positions, left_keys), "StrictGPTModel: position_ids other than each row's index")
print("done")
"""


def test_strict_gpt_model_gives_each_sequence_its_bits_alone_in_every_batch_layout():
    """StrictGPTModel, fed the layouts trainers use (right padding with a causal or a key-padding mask, left padding
    with shifted position_ids, a THD pack with cu_seqlens), gives every sequence the bits of its logits and of the
    strict logprob head's loss alone, a pack's layout read once a forward; the stock model does not (the negative
    control); what strict attention does not compute (holed or bidirectional masks, float masks, padded packs,
    context / pipeline / expert / sequence parallelism, shifted positions under recomputation) raises one ValueError
    line."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(FIXTURE)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("same bits:") == 4 and proc.stdout.count("refused:") == 12, proc.stdout
    assert "pack read once a forward" in proc.stdout


def test_hf_strict_attention_gives_right_and_left_padded_sequences_their_bits_alone():
    """The same contract in the HF strict swap: a right-padded batch (the HF engine's own) and a left-padded one
    (pads masked at the start, position_ids counting from each row's first token, as HF's generate makes them)
    give each sequence the bits of its logits alone; a mask with a hole is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from alignaudit.engines.hf.strict import make_strict
    from alignaudit.inputs.strict_ops import STRICT_OPS

    model = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.bfloat16).eval()
    make_strict(model, frozenset(STRICT_OPS))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    bits = lambda t: t.contiguous().view(torch.int16)  # noqa: E731
    with torch.no_grad():
        alone = [model(input_ids=ids[r : r + 1, :n]).logits[0] for r, n in ((0, 12), (1, 9))]
        right = torch.ones(2, 12, dtype=torch.long)
        right[1, 9:] = 0
        batch = model(input_ids=ids, attention_mask=right).logits
        assert torch.equal(bits(batch[0]), bits(alone[0])) and torch.equal(bits(batch[1, :9]), bits(alone[1]))
        left_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[1:, :9]], dim=1)
        left = torch.ones(2, 12, dtype=torch.long)
        left[1, :3] = 0
        positions = (left.cumsum(1) - 1).clamp(min=0)
        batch = model(input_ids=torch.cat([ids[:1], left_ids]), attention_mask=left, position_ids=positions).logits
        assert torch.equal(bits(batch[0]), bits(alone[0])) and torch.equal(bits(batch[1, 3:]), bits(alone[1]))
        holed = torch.ones(2, 12, dtype=torch.long)
        holed[1, 4] = 0
        with pytest.raises(ValueError, match="attention_mask must be causal over one contiguous run of keys per row"):
            model(input_ids=ids, attention_mask=holed)
        ones = torch.ones(2, 1, 12, 12)  # additive: +1 on every score, i.e. attend everything, bidirectionally
        with pytest.raises(ValueError, match="attention_mask must be causal over one contiguous run of keys per row"):
            model(input_ids=ids, attention_mask=ones)


def test_hf_strict_attention_gives_packed_sequences_their_bits_alone():
    """Sequences packed in one row by position_ids restarting at 0, as TRL's padding_free and verl's remove-padding
    batches are fed (no KV cache: transformers then builds a block-causal mask): each gets the bits of its logits
    alone. Before, the block-causal mask was read as left padding and the first sequence's attention was zeros.
    Positions that do not count 0, 1, 2, ... within a sequence, with no mask to say otherwise, are refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from alignaudit.engines.hf.strict import make_strict
    from alignaudit.inputs.strict_ops import STRICT_OPS

    model = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.bfloat16).eval()
    make_strict(model, frozenset(STRICT_OPS))
    lengths = (5, 4, 3)
    seqs = [torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    bits = lambda t: t.contiguous().view(torch.int16)  # noqa: E731
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = [model(input_ids=s, use_cache=False).logits[0] for s in seqs]
        packed = model(input_ids=torch.cat(seqs, 1), position_ids=positions, use_cache=False).logits[0]
        ends = torch.tensor(lengths).cumsum(0).tolist()
        for s, (first, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            assert torch.equal(bits(packed[first:end]), bits(alone[s])), s
        from alignaudit.engines.hf.strict import packed_runs

        with pytest.raises(ValueError, match="do not count 0, 1, 2"):
            packed_runs(torch.tensor([[0, 1, 2, 0, 2, 3]]), None, 1, 6)


def test_hf_strict_attention_under_torch_compile_keeps_right_padding_and_refuses_left_padding():
    """Compiled (one graph, the layout checked by device-side asserts over int reductions), a right-padded batch
    gets the eager bits; left padding, which needs a host-side cut per row, is refused with the mask message."""
    import torch
    from transformers import AutoModelForCausalLM

    from alignaudit.engines.hf.strict import make_strict
    from alignaudit.inputs.strict_ops import STRICT_OPS

    model = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.bfloat16, attn_implementation="eager")
    make_strict(model.eval(), frozenset(STRICT_OPS))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    right, left = torch.ones(2, 12, dtype=torch.long), torch.ones(2, 12, dtype=torch.long)
    right[1, 9:], left[1, :3] = 0, 0
    forward = torch.no_grad()(lambda mask: model(input_ids=ids, attention_mask=mask).logits)
    compiled = torch.compile(forward)
    assert torch.equal(compiled(right).view(torch.int16), forward(right).view(torch.int16))
    with pytest.raises(RuntimeError, match="computed out of torch.compile only"):
        compiled(left)
