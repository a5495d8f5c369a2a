"""The Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (fp32, small shapes), in a subprocess
because the variable must be set before Triton decorates the kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FIXTURE, ROOT

pytestmark = pytest.mark.long

HERE = Path(__file__).resolve().parent
# the per-op kernel tests (test_kernels_compile.py builds for GPUs instead; test_compile.py needs Inductor)
OP_TESTS = [
    str(p)
    for p in sorted(HERE.glob("test_*.py"))
    if p.name not in ("test_kernels_interpret.py", "test_kernels_compile.py", "test_compile.py")
]


def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *OP_TESTS,
            "--kernel-device",
            "interpret",
            "-k",
            "not backward",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed >= 14, proc.stdout[-2000:]  # the fp32 kernel tests ran, not only skips


STRICT_EXP_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM
from alignaudit.engines.hf.strict import make_strict
from alignaudit.engines.base import applied_exp
ids = torch.arange(3, 40)[None]
logits = {}
for exp in ("portable", "native", "portable"):
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="eager").eval()
    make_strict(model, frozenset({"attention"}), exp=exp)
    assert applied_exp(model) == exp
    with torch.no_grad():
        logits.setdefault(exp, []).append(model(ids).logits)
same = torch.equal(logits["portable"][0], logits["portable"][1])
differ = int((logits["portable"][0] != logits["native"][0]).sum())
print(f"portable twice equal: {same}; native differs in {differ} of {logits['native'][0].numel()} logits")
"""


def test_strict_exp_reaches_hf_attention_under_the_interpreter():
    """--strict-exp native cannot run on the CPU backend; under the interpreter (which has both exps) the hf
    strict attention computes with the exp make_strict was given: the logits move with it, and the manifest
    reads it back from the modules (applied_exp)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", STRICT_EXP_SCRIPT, str(FIXTURE)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    same, differ = re.search(r"portable twice equal: (\w+); native differs in (\d+)", proc.stdout).groups()
    assert same == "True" and int(differ) > 0, proc.stdout
