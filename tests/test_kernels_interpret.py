"""The Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (fp32, small shapes), in a subprocess
because the variable must be set before Triton decorates the kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_kernels.py"),
         "--kernel-device", "interpret", "-k", "not backward"],
        capture_output=True, text=True, env=env, cwd=HERE.parent,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed >= 14, proc.stdout[-2000:]  # the fp32 kernel tests ran, not only skips
