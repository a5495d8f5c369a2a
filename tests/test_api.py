"""The Python API (alignaudit.api, docs/api.md), used only through its documented functions.

The claim from a user script: a strict Megatron-Core trainer model and a strict transformers model, each built
in one call, score a hand-made rollout batch with the same bits (token_logprobs), and the in-loop hook
(mismatch_metrics) counts exactly the tokens a rollout engine got wrong; compare() reproduces the strict
megatron-vs-vllm comparison with 0 mismatching tokens, and the default one with every token differing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from alignaudit import api
from alignaudit.errors import InputError
from helpers import FIXTURE

pytestmark = pytest.mark.engines

USER_SCRIPT = """
import sys, torch
from alignaudit import api

megatron = api.strict_megatron_model("qwen3-tiny", device="cpu")
hf = api.strict_hf_model(sys.argv[1], device="cpu")
g = torch.Generator().manual_seed(1)
batch = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (17, 9, 30)]  # token ids, ragged
trainer = api.token_logprobs(megatron, batch)
assert [len(t) for t in trainer] == [16, 8, 29]
same = api.token_logprobs(hf, batch)
assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(trainer, same)), "hf != megatron"
for bad, message in (([[1, 600, 3]], "outside the vocabulary"), ([[1.5, 2.0]], "integers"),
                     ([list(range(2)) * 600], "more than the model's 1024 positions"), ([[1]], "at least 2")):
    try:
        api.token_logprobs(hf, bad)
    except Exception as e:
        assert type(e).__name__ == "InputError" and message in str(e), e
    else:
        raise AssertionError(f"accepted: {message}")
alone = api.token_logprobs(megatron, batch[1:2])[0]
assert torch.equal(alone.view(torch.int32), trainer[1].view(torch.int32)), "a sequence alone differs from batched"

# the hook on a hand-made rollout batch: the rollout engine's logprobs, one token one ULP off, one 0.01 off
rollout = [t.clone() for t in trainer]
rollout[0][3] = torch.nextafter(rollout[0][3], torch.tensor(0.0))
rollout[2][7] += 0.01
m = api.mismatch_metrics(trainer, rollout)
assert (m["tokens_compared"], m["mismatches"]) == (53, 2), m
assert m["ulp_histogram"]["1"] == 1 and m["ulp_max"] > 1000
assert abs(m["max_abs_diff"] - 0.01) < 1e-4 and m["rl"]["clip_fraction"] == 0.0
assert api.mismatch_metrics(trainer, same)["mismatches"] == 0

# a weight sync: the HF model's weights against themselves, then one bit flipped
weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
assert api.verify_weight_sync(weights, {k: v.clone() for k, v in weights.items()}).equal
flipped = {k: v.clone() for k, v in weights.items()}
name = "model.layers.0.mlp.down_proj.weight"
flipped[name].view(torch.int16).view(-1)[0] ^= 1
sync = api.verify_weight_sync(weights, flipped)
assert not sync.equal and sync.differing == [name] and sync.missing == []
print("ok")
"""


def test_a_user_script_builds_both_strict_models_and_the_hook_counts_what_differs():
    proc = subprocess.run(
        [sys.executable, "-c", USER_SCRIPT, str(FIXTURE)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_compare_reproduces_the_strict_claim_and_the_default_mismatch(tmp_path):
    strict = api.compare("qwen3-tiny", strict="all", out=tmp_path / "strict")
    assert strict.bitwise_equal and (strict.tokens_compared, strict.mismatches) == (176, 0)
    assert len(strict.tokens) == 176 and strict.tokens["bitwise_equal"].all() and len(strict.sequences) == 4
    assert strict.summary["sides"]["infer"]["engine"] == "vllm" and strict.path == tmp_path / "strict"
    default = api.compare(out=tmp_path / "default")
    assert (default.tokens_compared, default.mismatches) == (176, 176) and default.ulp_max > 0
    with pytest.raises(InputError, match="is not empty"):  # nothing already written is lost
        api.compare(out=tmp_path / "default")
    with pytest.raises(InputError, match="unknown engine 'deepspeed'"):
        api.compare(train="deepspeed", out=tmp_path / "bad")
    with pytest.raises(InputError, match="mode 'decode'"):
        api.compare(mode="decode", out=tmp_path / "bad")


def test_compare_takes_the_framework_rollout_shape(tmp_path):
    """The API's rollout arguments reach vLLM as the CLI's flags do: 2 completions a prompt as one request, through
    AsyncLLM, EOS on and no prompt logprobs (vLLM's defaults, resolved and recorded); strict: bitwise equal."""
    import json

    run = api.compare(
        strict="all",
        mode="rollout",
        max_new_tokens=8,
        group_size=2,
        engine_mode="async",
        arrival_gap=0.01,
        out=tmp_path / "shaped",
    )
    assert run.bitwise_equal and run.tokens_compared == run.generated["tokens_compared"] > 0
    assert len(run.sequences) == 8  # 4 prompts x 2
    shape = json.loads((run.path / "run.json").read_text())["rollout"]
    assert (shape["group_size"], shape["stop_at_eos"], shape["prompt_logprobs"]) == (2, True, False)
    assert (shape["engine_mode"], shape["arrival_gap_s"]) == ("async", 0.01)


def test_the_hook_refuses_logprobs_that_do_not_pair_up():
    a = [torch.zeros(3), torch.zeros(2)]
    with pytest.raises(InputError, match="disagree"):
        api.mismatch_metrics(a, [torch.zeros(3), torch.zeros(3)])
    with pytest.raises(InputError, match="no tokens to compare"):
        api.mismatch_metrics([], [])
    padded = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    other = padded.clone()
    other[1, 3] = 5.0  # a pad: not compared
    other[0, 1] = -1.0
    m = api.mismatch_metrics(padded, other, mask=mask)
    assert (m["tokens_compared"], m["mismatches"]) == (5, 1)
    for bad in (0.5, float("inf")):  # equal on both sides, yet no log-probability: refused, never "0 mismatches"
        with pytest.raises(InputError, match=r"train_logprobs: sequence 1: logprob 1 is .*, above 0"):
            pair = [torch.zeros(2), torch.tensor([-1.0, bad])]
            api.mismatch_metrics(pair, [t.clone() for t in pair])
    with pytest.raises(InputError, match="rollout_logprobs: every logprob is >= 0: these are negative log-likelihoods"):
        api.mismatch_metrics([torch.tensor([-0.5, -1.0])], [torch.tensor([0.5, 1.0])])
    nan = api.mismatch_metrics([torch.tensor([float("nan"), -float("inf")])], [torch.tensor([-1.0, -1.0])])
    assert nan["tokens_compared"] == 2  # NaN and -inf are results, counted apart, not refused
    with pytest.raises(InputError, match="differ in shape"):
        api.mismatch_metrics(padded, other, mask=mask[:, :3])
    for kwargs, message in (
        ({"mask": mask.float()}, "mask must be a bool tensor"),
        ({"mask": mask.tolist()}, "mask must be a bool tensor"),
        ({"clip_eps": -0.2}, "clip-eps"),
        ({"clip_eps": "0.2"}, "a number in"),
    ):
        with pytest.raises(InputError, match=message):
            api.mismatch_metrics(padded, other, **kwargs)
    with pytest.raises(InputError, match="a list of 1-D tensors"):
        api.mismatch_metrics(None, None)
    with pytest.raises(InputError, match="must be 1-D"):
        api.mismatch_metrics([padded], [other])


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    """What would be ignored, or would fail deep inside, is one InputError line naming it."""
    with pytest.raises(InputError, match="selects no strict op"):
        api.strict_megatron_model("qwen3-tiny", ops="", device="cpu")
    with pytest.raises(InputError, match="unknown op"):
        api.strict_hf_model("qwen3-tiny", ops="all,bogus", device="cpu")
    with pytest.raises(InputError, match="not a comma-separated string"):
        api.strict_hf_model("qwen3-tiny", ops=["linear"], device="cpu")
    with pytest.raises(InputError, match=r"^exp native is the GPU's exp2 .* use device='cuda', or drop exp$"):
        api.strict_hf_model("qwen3-tiny", exp="native", device="cpu")  # the API's own names, not the CLI's flags
    with pytest.raises(
        InputError, match="^exp native sets the exp of strict attention, .*: add attention to ops, or drop exp$"
    ):
        api.strict_hf_model("qwen3-tiny", ops="linear", exp="native", device="cpu")
    with pytest.raises(InputError, match="an empty sync would pass unchecked"):
        api.verify_weight_sync({}, {})
    with pytest.raises(InputError, match="a dict of HF name -> tensor"):
        api.verify_weight_sync([torch.zeros(1)], {})
    with pytest.raises(InputError, match="token_logprobs takes a model"):
        api.token_logprobs("qwen3-tiny", [[1, 2]])
    for kwargs, message in (
        ({"prompts": [[1, 2, 3]]}, "prompts: a file path"),
        ({"train_options": ["a=1"]}, "train_options: a dict"),
        ({"max_new_tokens": "8", "mode": "rollout"}, "max_new_tokens '8': an integer"),
        ({"temperature": 0.5}, "^temperature applies to rollouts"),
        # the rollout defaults given in prompt mode: refused too (they would not take effect)
        ({"max_new_tokens": 32}, "^max_new_tokens applies to rollouts"),
        ({"top_k": 0}, "^top_k applies to rollouts"),
        ({"mode": "rollout", "temperature": float("nan")}, "^temperature nan: rollout mode"),
        ({"mode": "rollout", "max_new_tokens": 0}, "^max_new_tokens 0: rollout mode samples"),
        ({"repeat": 2, "mode": "rollout"}, "^repeat reruns teacher-forced prompts"),
        ({"repeat": True}, "^repeat True: give the number of runs per engine"),
        ({"group_size": 2}, "^group_size applies to rollouts"),
        ({"mode": "rollout", "stop_at_eos": "yes"}, "stop_at_eos 'yes': True, False or None"),
        ({"mode": "rollout", "engine_mode": "server"}, "^engine_mode 'server': choose one of"),
        ({"mode": "rollout", "infer": "hf", "group_size": 2}, "^group_size: hf rollouts"),
    ):
        with pytest.raises(InputError, match=message):
            api.compare(out=tmp_path / "never", **kwargs)
    assert not (tmp_path / "never").exists()


def test_wrong_types_get_the_documented_error_not_a_raw_one(tmp_path, monkeypatch):
    """Every argument the API takes is checked for type and meaning and refused with InputError (the CLI's rule):
    none reaches torch or the engines as a TypeError, and no value is silently changed on its way in."""
    hf = api.strict_hf_model("qwen3-tiny", device="cpu")
    for sequences, message in (
        (None, "sequences: a list of token-id sequences"),
        ("some text", r"1-D integer tensors\), not str"),
        (["text"], "sequence 0 is text"),
        ([[1, 2**70]], "sequence 0: not a list of token ids"),
    ):
        with pytest.raises(InputError, match=message):
            api.token_logprobs(hf, sequences)
    lp = [torch.tensor([-1.0, -2.0])]
    for train, rollout, message in (
        (
            [torch.tensor([-1.0, -2.0], dtype=torch.float64)],
            [torch.tensor([-1.0, -2.0 + 1e-12], dtype=torch.float64)],
            "float64 logprobs that fp32 cannot hold exactly",
        ),
        ([torch.tensor([1, 2])], lp, "has dtype torch.int64"),
        ([torch.tensor([True, False])], lp, "torch.bool"),
        ([torch.tensor([-1 + 1j, -2j])], lp, "torch.complex64"),
        (["ab"], lp, r"train_logprobs\[0\] is text"),
        ("ab", lp, "not str"),
        ([torch.empty(2, device="meta")], lp, "is a meta tensor"),
    ):
        with pytest.raises(InputError, match=message):
            api.mismatch_metrics(train, rollout)
    with pytest.raises(InputError, match="float64 logprobs that fp32 cannot hold exactly"):
        api.mismatch_metrics([[-1.0, -2.0 + 1e-12]], [[-1.0, -2.0]])  # Python floats are float64 too
    assert api.mismatch_metrics([[-1.0, -0.5]], [torch.tensor([-1.0, -0.5])])["mismatches"] == 0
    exact = [torch.tensor([-1.0, -0.5], dtype=torch.float64)]  # fp64 values fp32 holds exactly: taken as they are
    assert api.mismatch_metrics(exact, [torch.tensor([-1.0, -0.5])])["mismatches"] == 0
    assert api.mismatch_metrics([lp[0].bfloat16()], lp)["mismatches"] == 0  # bf16 -> fp32 is exact
    with pytest.raises(InputError, match="clip_eps 'abc': a number"):
        api.mismatch_metrics(lp, lp, clip_eps="abc")
    with pytest.raises(InputError, match="meta tensor"):
        api.verify_weight_sync({"w": torch.empty(2, device="meta")}, {"w": torch.zeros(2)})
    quantized = torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 0, torch.qint8)  # a byte view of it segfaulted
    for weight, says in (
        (quantized, "is quantized"),
        (torch.randn(4, 4).to_sparse(), "sparse"),
        (torch.zeros(2, dtype=torch.int32), "is torch.int32"),
    ):
        with pytest.raises(InputError, match=rf"trainer\['w'\] {says}|trainer\['w'\] is .*{says}"):
            api.verify_weight_sync({"w": weight}, {"w": weight})
    monkeypatch.chdir(tmp_path)
    for kwargs, message in (
        ({"temperature": "0.7", "mode": "rollout"}, "temperature '0.7': a number"),
        ({"clip_eps": "abc"}, "clip_eps 'abc': a number"),
        ({"out": 123}, "out 123: a directory"),
        ({"out": ""}, "^out is empty"),
        ({"force": "yes"}, "force 'yes': True or False"),
        ({"random_prompts": 2, "prompt_len": 0}, "prompt_len >= 2"),
    ):
        with pytest.raises(InputError, match=message):
            api.compare(**kwargs)
    assert list(tmp_path.iterdir()) == []  # compare(out="") took over the current directory before


def test_rl_from_python_with_a_python_reward_and_held_out_prompts(tmp_path):
    """api.rl runs alignaudit rl's loop with a reward that is a Python function (no module file needed): it is given
    the prompt file's columns as TRL passes dataset columns, every token is bitwise equal at every step, the held-out
    prompts are scored with it, and run.json names it. Wrong arguments are refused with the API's names."""
    import json

    import pandas as pd

    calls = []

    def answer_length(prompts, completions, completion_ids, answer, **kwargs):
        calls.append(list(answer))
        return [float(len(ids) == len(a) + 1) for ids, a in zip(completion_ids, answer, strict=True)]

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text(
        "".join(
            json.dumps({"text": q, "answer": a}) + "\n"
            for q, a in (("1+2=", "3"), ("30+4=", "34"), ("55+45=", "100"), ("7+8=", "15"))
        )
    )
    held.write_text(json.dumps({"text": "12+30=", "answer": "42"}) + "\n")
    run = api.rl(
        "qwen3-tiny-trained",
        strict="all",
        steps=2,
        group_size=2,
        prompts=train,
        prompts_per_step=2,
        reward=answer_length,
        eval_prompts=held,
        max_new_tokens=4,
        out=tmp_path / "rl",
    )
    assert run.aligned and list(run.steps["step"]) == [1, 2] and list(run.evals["step"]) == [0, 2]
    assert calls[0] == ["42"] and all(len(c) == 4 for c in calls[1:3])  # held-out first, then 2 prompts x 2
    assert run.record["rl"]["reward"].endswith(
        ":test_rl_from_python_with_a_python_reward_and_held_out_prompts.<locals>.answer_length"
    )
    assert run.record["reward_function"]["file"] == __file__
    rows = pd.read_parquet(run.path / "eval" / "step-00002.parquet")
    assert run.evals["reward_mean"].iloc[-1] == rows["reward"].mean()
    for kwargs, says in (
        ({"reward": 3}, "reward 3: a built-in reward's name"),
        ({"steps": "2"}, "steps '2': an integer"),
        ({"eval_every": -1}, "eval_every -1: a number of steps"),
        ({"prompts_per_step": 9}, "prompts_per_step 9: there are 4 prompts"),
    ):
        with pytest.raises(InputError, match=says):
            api.rl("qwen3-tiny-trained", prompts=train, out=tmp_path / "refused", **kwargs)
    assert not (tmp_path / "refused").exists()
