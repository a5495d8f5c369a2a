"""GRPO's pure pieces (alignaudit.rl.grpo): the toy rewards on known token ids, the k3 KL term, and the
refusal of an unknown reward or a negative KL weight before any engine starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from alignaudit.errors import EXIT_USAGE
from alignaudit.rl.grpo import REWARDS, ROTATION, token_score
from alignaudit.training.losses import kl_k3
from helpers import one_line_error


def test_kl_k3_is_zero_at_the_reference_and_exp_r_minus_r_minus_1_elsewhere():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    assert torch.equal(kl_k3(lp, lp.detach().clone()), torch.zeros(3))  # bits equal -> exactly 0
    ref = torch.tensor([-2.0, -1.0, -0.5])
    k = kl_k3(lp, ref)
    expected = torch.tensor([np.exp(-1.0) + 1.0 - 1.0, np.exp(1.0) - 1.0 - 1.0, 0.0], dtype=torch.float32)
    assert torch.allclose(k, expected, rtol=0, atol=1e-6) and (k >= 0).all()
    k.sum().backward()  # d/dlp (e^(ref-lp) - (ref-lp) - 1) = 1 - e^(ref-lp): non-zero wherever lp != ref
    assert torch.allclose(lp.grad, 1 - torch.exp(ref - lp.detach()), rtol=0, atol=1e-6) and lp.grad[2] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--reward", "length"], "--reward length: not a reward; choose one of rotating-hash, token-hash, even"),
        (["--kl-coef", "-0.1"], "--kl-coef -0.1: the KL weight must be finite and >= 0 (0: no KL term)"),
        (["--kl-coef", "inf"], "--kl-coef inf: the KL weight must be finite and >= 0"),
        (["--lr", "inf"], "--lr inf: the learning rate must be finite and >= 0"),
        (["--kl-coef", "0.04", "--lr", "0"], "--kl-coef 0.04 with --lr 0: the weights never leave the reference"),
        (
            ["--kl-coef", "0.04", "--top-p", "0.95", "--infer-opt", "logprobs_mode=processed_logprobs"],
            "--kl-coef 0.04 with processed logprobs and --top-k 0 / --top-p 0.95: the reference's truncation gives "
            "-inf",
        ),
    ],
)
def test_rl_refuses_bad_rl_settings_before_any_engine(capsys, tmp_path, argv, message):
    out = tmp_path / "r"
    assert message in one_line_error(capsys, ["rl", *argv, "--out", str(out)], EXIT_USAGE)
    assert not (out / "run.json").exists()


def test_the_rewards_on_known_token_ids():
    assert REWARDS["token-hash"]([], 1) == 0.0 and REWARDS["token-hash"]([0], 1) == 0.0
    assert REWARDS["token-hash"]([1, 2], 7) == (2654435761 + (2 * 2654435761) % 2**32) / 2 / 2**32
    assert REWARDS["even"]([2, 3, 4, 6], 1) == 0.75
    # SplitMix64's published first output for seed 0 (state 0x9E3779B97F4A7C15): 0xE220A8397B1DCDAF
    assert token_score(0, 0) == (0xE220A8397B1DCDAF >> 11) / 2**53
    rotating = REWARDS["rotating-hash"]
    assert rotating([5, 9], 1) == rotating([5, 9], ROTATION) == (token_score(5, 0) + token_score(9, 0)) / 2
    assert rotating([5, 9], ROTATION + 1) == (token_score(5, 1) + token_score(9, 1)) / 2 != rotating([5, 9], 1)
    # each period's table is its own: over 2000 token ids, scores of consecutive periods are uncorrelated
    a = np.array([token_score(t, 0) for t in range(2000)])
    b = np.array([token_score(t, 1) for t in range(2000)])
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.1 and 0.45 < a.mean() < 0.55 and len(set(a)) == 2000


def test_plain_training_steps_the_given_adam_and_refuses_an_offload():
    """An engine without an optimizer of its own (HF) trains under the caller's Adam: one step with lr 0 writes
    back the same bits and returns the grad norm; an optimizer offload is refused (megatron.core's, CUDA only)."""
    from types import SimpleNamespace

    from alignaudit.engines.training import PlainTraining
    from alignaudit.training.optim import MixedPrecisionAdam

    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    engine = SimpleNamespace(name="hf", settings=SimpleNamespace(device="cpu"), model=model)
    before = [p.detach().clone() for p in model.parameters()]
    training = PlainTraining(engine, lr=0.0, clip_grad=1.0, offload_fraction=0.0, adam=MixedPrecisionAdam)
    assert training.name == "alignaudit.training.optim.MixedPrecisionAdam"
    training.zero_grad()
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    training.finalize_grads()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    assert training.step() == pytest.approx(float(torch.linalg.vector_norm(grads)), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="optimizer offload is megatron.core's"):
        PlainTraining(engine, lr=0.0, clip_grad=1.0, offload_fraction=0.5, adam=MixedPrecisionAdam)
