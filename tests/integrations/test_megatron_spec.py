"""slime's and miles' ``--spec alignaudit.integrations.megatron_spec.strict_spec``: their model provider calls it with
(args, config, vp_stage) and builds a plain GPTModel from what it returns (slime/backends/megatron_utils/
model_provider.py).

Chain: a GPTModel built the way slime builds it, from strict_spec with ``position_embedding_type`` "none", and given
the fixture's weights, computes the final hidden states of a THD pack (slime trains on packs) and of a right-padded
batch with the bits alignaudit's own StrictGPTModel computes; GPTModel from Megatron's local spec does not on the
padded batch (the negative control; its DotProductAttention refuses packs). Settings the spec cannot honour are
refused with the reason. Real megatron-core on the fixture, in a subprocess (Megatron keeps process-global parallel
state).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import FIXTURE

pytestmark = pytest.mark.engines

SCRIPT = """
import sys, types, torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from alignaudit import api
from alignaudit.errors import InputError
from alignaudit.integrations.megatron_spec import strict_spec

strict = api.strict_megatron_model(sys.argv[1], device="cpu")
config = strict.config
args = types.SimpleNamespace(position_embedding_type="none", rotary_base=1000000, qk_layernorm=True,
                             normalization="RMSNorm", num_experts=None, use_rope_scaling=False)

def slime_gpt(spec, position_embedding_type):  # slime's model_provider, the arguments the fixture needs
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=strict.vocab_size,
                   max_sequence_length=strict.max_sequence_length, position_embedding_type=position_embedding_type,
                   rotary_base=1000000, share_embeddings_and_output_weights=strict.share_embeddings_and_output_weights,
                   parallel_output=True)
    missing, unexpected = gpt.load_state_dict(strict.state_dict(), strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (missing, unexpected)
    return gpt.to(torch.bfloat16).eval()

def hidden(gpt, *inputs, **kw):  # the decoder's output (the final norm's), [s, b, h]
    seen = []
    handle = gpt.decoder.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        gpt(*inputs, **kw)
    handle.remove()
    return seen[0].contiguous().view(torch.int16)

g = torch.Generator().manual_seed(0)
lengths = (12, 9, 5)
seqs = [torch.randint(0, 512, (n,), generator=g) for n in lengths]
cu = torch.tensor([0, 12, 21, 26], dtype=torch.int32)
packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
right = torch.zeros(3, 12, dtype=torch.long)
keys = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None].expand(3, 1, 12, 12).clone()
for i, x in enumerate(seqs):
    right[i, :len(x)] = x
    keys[i, :, :, len(x):] = True
batches = {"packed (THD)": ((torch.cat(seqs)[None], None, None), {"packed_seq_params": packed}),
           "right-padded": ((right, None, keys), {})}
spec_gpt = slime_gpt(strict_spec(args, config, None), "none")
stock_gpt = slime_gpt(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), "rope")
for name, (inputs, kw) in batches.items():
    want = hidden(strict, *inputs, **kw)
    rows = [(0, slice(0, 26))] if "packed" in name else [(i, slice(0, n)) for i, n in enumerate(lengths)]
    for b, span in rows:  # the padded rows' pads are no token's: not compared
        assert torch.equal(hidden(spec_gpt, *inputs, **kw)[span, b], want[span, b]), name
        if not kw:  # Megatron's local DotProductAttention refuses packs (it asks for TransformerEngine's)
            assert not torch.equal(hidden(stock_gpt, *inputs, **kw)[span, b], want[span, b]), name
    print("same bits:", name)

for change, message in (({"position_embedding_type": "rope"}, "position_embedding_type='rope'"),
                        ({"num_experts": 8}, "num_experts=8"), ({"normalization": "LayerNorm"}, "RMSNorm"),
                        ({"multi_latent_attention": True}, "multi_latent_attention"),
                        ({"attention_dropout": 0.1}, "dropout")):
    try:
        strict_spec(types.SimpleNamespace(**{**vars(args), **change}), config, None)
    except InputError as e:
        assert message in str(e), (message, str(e))
    else:
        raise AssertionError(f"not refused: {change}")
try:
    strict_spec(args, config, 1)
except InputError as e:
    assert "vp_stage=1" in str(e)
else:
    raise AssertionError("vp_stage 1 not refused")
print("refusals: ok")
"""


def test_slime_spec_builds_a_gpt_model_with_the_strict_models_bits_and_refuses_what_it_cannot_honour():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(FIXTURE)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.splitlines()[-3:] == ["same bits: packed (THD)", "same bits: right-padded", "refusals: ok"]
