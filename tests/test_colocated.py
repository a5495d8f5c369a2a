"""A trainer and vLLM in one process, as TRL's colocate mode runs them (vLLM's offline LLM with
VLLM_ENABLE_V1_MULTIPROCESSING=0 beside the policy being trained), through the public API only.

Chain of reasoning (strict): vLLM samples with the strict plugin inside torch.inference_mode, which builds the
process-wide rope tables first; the strict policy then trains in the same process on those tables. Its forward
gives the bits vLLM recorded for every sampled token (both sides strict), and its backward runs (tables built in
inference mode would be inference tensors, which autograd refuses to save). Default: a weight sync done as TRL
does it (``model.load_weights`` alone) leaves vLLM's packed CPU GEMMs with the old weights while the parameters
hold the new ones; ``verify_weight_sync`` given the running LLM says so, and after ``load_vllm_weights`` says
equal. ``load_vllm_weights`` checks every tensor before writing any: a sync with one bad tensor (shape, name, dtype)
is refused and leaves vLLM's weights as they were.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import FIXTURE

pytestmark = [pytest.mark.engines, pytest.mark.long]

START = """
import os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from alignaudit import api
import alignaudit_kernels as K

def start(fixture):
    return LLM(model=fixture, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 26, seed=0,
               skip_tokenizer_init=True, enforce_eager=True)

prompts = [[5, 17, 99, 3, 250, 11], [7, 300, 42]]
"""

STRICT = (
    START
    + """
llm = start(sys.argv[1])
kernels = api.verify_strict_vllm(llm)  # read back where the model computes
assert kernels["strict_ops"] == ["attention", "linear", "logprobs", "rmsnorm", "rope", "silu"], kernels
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=8, logprobs=0, temperature=1.0, seed=3, ignore_eos=True))
policy = api.strict_hf_model(sys.argv[1], device="cpu")
policy.train()
total = 0
for prompt, out in zip(prompts, outs, strict=True):
    generated = out.outputs[0].token_ids
    rollout = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, generated, strict=True)])
    ids = torch.tensor([prompt + list(generated)])
    logits = policy(input_ids=ids).logits[0, :-1]
    lp = K.token_logprobs(logits, ids[0, 1:])[len(prompt) - 1:]
    assert torch.equal(lp.detach().float().view(torch.int32), rollout.float().view(torch.int32)), (lp, rollout)
    (-lp.float().sum()).backward()  # raised "Inference tensors cannot be saved for backward" in rope
    total += len(generated)
grads = [p.grad for p in policy.parameters() if p.requires_grad]
assert all(g is not None and torch.isfinite(g).all() for g in grads)
print("ok", total)
"""
)

SYNC = (
    START
    + """
from alignaudit.errors import EngineError
api.keep_vllm_weights()
llm = start(sys.argv[1])
try:  # no ALIGNAUDIT_STRICT: the read-back says so
    api.verify_strict_vllm(llm)
    raise SystemExit("a default vLLM passed the strict read-back")
except EngineError as e:
    assert "not applied when vLLM built this model: attention, linear" in str(e), e
packs = sys.argv[2] == "1"
weights = {k: v.clone() for k, v in api.vllm_weights(llm).items()}
assert api.verify_weight_sync(weights, llm).equal
new = {k: (v.float() * 1.5).to(v.dtype) for k, v in weights.items()}
llm.apply_model(lambda model: model.load_weights(iter(new.items())))  # TRL's sync: no post-load step
trl = api.verify_weight_sync(new, llm)
assert trl.covers_engine_copies and trl.differing == [] and trl.missing == []
assert trl.equal is not packs and bool(trl.stale_packed) is packs, trl
assert not api.verify_weight_sync(new, weights).covers_engine_copies
# a sync with one bad tensor, last, is refused before anything is written: the others (doubled) never reach vLLM
from alignaudit.errors import InputError
doubled = {k: (v.float() * 2).to(v.dtype) for k, v in new.items()}
first = next(iter(new))
for key, value, says in (("model.norm.weight", torch.zeros(3), "has shape (3,)"),
                         ("model.nope.weight", new[first], "not a tensor of this model's checkpoint"),
                         (first, new[first].to(torch.int32), "is torch.int32; give the values in a floating dtype")):
    bad = {k: v for k, v in doubled.items() if k != key}
    bad[key] = value
    try:
        api.load_vllm_weights(llm, bad)
        raise SystemExit(f"not refused: {key}")
    except InputError as e:
        assert says in str(e) and "nothing was loaded" in str(e), e
    assert api.verify_weight_sync(new, llm).differing == [], key
api.load_vllm_weights(llm, new)
after = api.verify_weight_sync(new, llm)
assert after.equal and after.stale_packed == [], after
# registering the plugin after the model was built does not make it strict: still refused (last: it patches vLLM)
os.environ["ALIGNAUDIT_STRICT"] = "all"
from alignaudit.engines.vllm import plugin
plugin.register()
try:
    api.verify_strict_vllm(llm, "linear,rmsnorm,rope,silu,logprobs")
    raise SystemExit("a model built before the plugin passed the strict read-back")
except EngineError as e:
    assert "not applied when vLLM built this model" in str(e), e
print("ok", ",".join(trl.stale_packed))
"""
)


def _run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", script, str(FIXTURE), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ALIGNAUDIT_STRICT": ""},
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_strict_policy_trains_beside_strict_vllm_with_the_bits_vllm_recorded():
    env_script = "import os; os.environ['ALIGNAUDIT_STRICT'] = 'all'\n" + STRICT
    assert "ok 16" in _run(env_script)


def test_weight_sync_check_sees_the_copies_vllm_computes_with():
    from helpers import vllm_packs_cpu_weights

    packs = vllm_packs_cpu_weights()
    stale = set(filter(None, _run(SYNC, "1" if packs else "0").split("ok ")[-1].strip().split(",")))
    linears = {
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert linears <= stale if packs else stale == set(), stale
