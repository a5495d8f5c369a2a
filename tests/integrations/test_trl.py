"""TRL's GRPOTrainer with alignaudit's integration (alignaudit.integrations.trl), judged by TRL's own metrics.

Chain: TRL 1.16 runs GRPO on the fixture with its colocated vLLM (the CPU wheel) rolling out and the policy
training, 2 steps with a weight sync between them, temperature 0.7, top-k 20, top-p 0.9 (so vLLM's processed
logprobs carry the whole sampling transform), the policy's parameters in float32 as TRL keeps them by default (vLLM
computes in the checkpoint's bf16) and TRL's entropy bonus on. With StrictGRPOTrainer, TRL's logged
``sampling/sampling_logp_difference/{mean,max}`` is exactly 0 and its importance ratio exactly 1 at both steps,
alignaudit's hook counts 0 mismatching tokens of 32, and every parameter tensor moved (the RMSNorm weights too, which
a bf16 policy at this learning rate leaves bit-identical); with TRL's own GRPOTrainer on the same settings the
difference is > 0 at both steps (the negative control). A second strict run without truncation and with TRL's KL
(beta 0.04) gets a strict reference model: TRL's ``kl`` is exactly 0 at step 1, where policy and reference are one
checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alignaudit.inputs.strict_ops import STRICT_OPS
from helpers import FIXTURE

pytestmark = [pytest.mark.engines, pytest.mark.long]
trl = pytest.importorskip("trl")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "trl_grpo.py"


def _grpo(tmp_path, how: str, *options: str) -> tuple[list[dict], dict]:
    # strict: VLLM_PLUGINS leaves the entry point out, so only StrictGRPOTrainer's own registration makes vLLM strict
    # (on the H200 alignaudit ran from a source tree, with no entry point, and TRL's vLLM computed non-strict)
    env = {k: v for k, v in os.environ.items() if k != "ALIGNAUDIT_STRICT"}
    if how == "strict":
        env["VLLM_PLUGINS"] = "none"
    out = tmp_path / "-".join((how, *options))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(FIXTURE), how, str(out), *options],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = json.loads(lines[-1][len("RESULT ") :])
    assert [s["step"] for s in steps] == [1, 2]
    kernels = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("KERNELS "))[8:])
    assert kernels["strict_ops"] == (sorted(STRICT_OPS) if how == "strict" else []), kernels
    moved = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("MOVED "))[6:])
    return steps, moved


def _assert_zero_difference(steps: list[dict]) -> None:
    for step in steps:
        assert step["sampling/sampling_logp_difference/mean"] == 0.0
        assert step["sampling/sampling_logp_difference/max"] == 0.0
        for name in ("min", "mean", "max"):
            assert step[f"sampling/importance_sampling_ratio/{name}"] == 1.0
        assert (step["alignaudit/tokens_compared"], step["alignaudit/mismatches"]) == (32.0, 0.0)
        assert step["alignaudit/ulp_max"] == 0.0 and step["grad_norm"] > 0


def test_strict_trl_grpo_logs_zero_logp_difference_and_default_does_not(tmp_path):
    steps, moved = _grpo(tmp_path, "strict")
    _assert_zero_difference(steps)
    assert moved == {"tensors": 25, "dtype": "torch.float32", "unchanged": []}
    assert all(step["entropy"] > 0 for step in steps)
    steps, moved = _grpo(tmp_path, "strict", "--beta", "0.04", "--top-k", "0", "--top-p", "1")
    _assert_zero_difference(steps)
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0  # the reference is strict; the policy moved from it
    assert moved["unchanged"] == []
    steps, _ = _grpo(tmp_path, "default")
    for step in steps:
        assert step["sampling/sampling_logp_difference/max"] > 0
        assert "alignaudit/mismatches" not in step


def test_a_bf16_forward_of_fp32_master_weights_has_the_bf16_models_bits_and_trains_them():
    """compute_in: the strict model kept in fp32 and computing in bf16 gives the logits of the strict model stored in
    bf16 bit for bit (what vLLM holds after a sync), and its backward reaches every fp32 parameter, norms included."""
    import torch

    from alignaudit import api
    from alignaudit.engines.hf.strict import compute_in
    from alignaudit.errors import InputError

    master = api.strict_hf_model(FIXTURE, dtype="fp32", device="cpu", compute_dtype="bf16")
    stored = api.strict_hf_model(FIXTURE, dtype="bf16", device="cpu")
    ids = torch.randint(0, master.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = master(input_ids=ids).logits, stored(input_ids=ids).logits
    assert a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    master(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    for name, p in master.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0, name
    with pytest.raises(InputError, match="is not strict and would compute in its parameters' dtype"):
        compute_in(api.strict_hf_model(FIXTURE, ops="linear", dtype="fp32", device="cpu"), torch.bfloat16)
    with pytest.raises(InputError, match="unknown dtype 'bfloat16'"):
        api.strict_hf_model(FIXTURE, dtype="fp32", device="cpu", compute_dtype="bfloat16")


def test_settings_the_two_sides_cannot_agree_under_are_refused_before_anything_starts(tmp_path):
    from trl import GRPOConfig

    from alignaudit.errors import InputError
    from alignaudit.integrations.trl import StrictGRPOTrainer

    base = {"output_dir": str(tmp_path), "use_vllm": True, "vllm_mode": "colocate", "report_to": [], "use_cpu": True}
    for change, message in (
        ({"use_vllm": False}, "use_vllm=False"),
        ({"vllm_mode": "server"}, "vllm_mode='server'"),
        ({"vllm_importance_sampling_correction": False}, "vllm_importance_sampling_correction"),
        ({"min_p": 0.1}, "min_p=0.1"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32"),
        ({"generation_kwargs": {"seed": 1}}, "generation_kwargs"),
        ({"vllm_structured_outputs_regex": "[0-9]+"}, "vllm_structured_outputs_regex"),
        ({"vllm_model_impl": "transformers"}, "vllm_model_impl='transformers'"),
        ({"beta": 0.04, "top_p": 0.9}, "beta=0.04 with top_k=0, top_p=0.9"),
        ({"top_k": 20, "num_iterations": 2}, "num_iterations=2"),
        ({"model_init_kwargs": {"dtype": "int8"}}, "model_init_kwargs dtype 'int8'"),
        ({"model_init_kwargs": {"dtype": ["bf16"]}}, r"model_init_kwargs dtype \['bf16'\]"),
    ):
        with pytest.raises(InputError, match=message):
            StrictGRPOTrainer(model=str(FIXTURE), reward_funcs=[], args=GRPOConfig(**{**base, **change}))
    for keyword, value, message in (
        ("peft_config", object(), "peft_config is not supported"),
        ("quantization_config", object(), "quantization_config is not supported"),
    ):
        with pytest.raises(InputError, match=message):
            StrictGRPOTrainer(model=str(FIXTURE), reward_funcs=[], args=GRPOConfig(**base), **{keyword: value})
    with pytest.raises(InputError, match="unexpected keyword argument 'no_such'"):
        StrictGRPOTrainer(model=str(FIXTURE), reward_funcs=[], args=GRPOConfig(**base), no_such=1)
    with pytest.raises(InputError, match="without the strict module swap"):
        from transformers import AutoModelForCausalLM

        StrictGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(FIXTURE), reward_funcs=[], args=GRPOConfig(**base))
    assert "ALIGNAUDIT_STRICT" not in os.environ or os.environ["ALIGNAUDIT_STRICT"] == ""


def test_fail_closed_stops_before_the_backward_pass():
    """The hook on a micro-batch whose rollout logprob is one ULP off at one completion token: counted, logged, and
    with fail_closed raised (compute_loss calls it before GRPOTrainer's loss, so no backward runs)."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch

    from alignaudit.integrations.trl import AlignmentError, StrictGRPOTrainer

    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    sampled = old.clone()
    sampled[1, 1] = torch.nextafter(sampled[1, 1], torch.tensor(0.0))
    inputs = {
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampled,
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }
    for fail_closed in (False, True):
        me = SimpleNamespace(
            fail_closed=fail_closed, _metrics={"train": defaultdict(list)}, model=SimpleNamespace(training=True)
        )
        if fail_closed:
            with pytest.raises(AlignmentError, match="1 of 5 completion tokens' trainer logprobs differ"):
                StrictGRPOTrainer._check_alignment(me, inputs)
        else:
            StrictGRPOTrainer._check_alignment(me, inputs)
        assert me._metrics["train"]["alignaudit/mismatches"] == [1.0]
        assert me._metrics["train"]["alignaudit/ulp_max"] == [1.0]


def test_a_vllm_that_is_not_strict_stops_the_constructor():
    """StrictGRPOTrainer reads back TRL's vLLM once TRL has built it (alignaudit.api.verify_strict_vllm, tested on a
    real vLLM in tests/test_colocated.py); where TRL 1.16 keeps no LLM, that is an EngineError too."""
    from alignaudit.errors import EngineError
    from alignaudit.integrations.trl import _check_vllm_is_strict

    with pytest.raises(EngineError, match="not at trainer.vllm_generation.llm"):
        _check_vllm_is_strict(None, frozenset({"rmsnorm"}))
