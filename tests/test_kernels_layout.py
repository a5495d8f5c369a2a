"""kernels/ is a plain folder (no __init__.py) holding the package alignaudit_kernels, so the checkout's root on
sys.path (``python -m`` or ``python -c`` from the root; bench/gpu_run.sh's PYTHONPATH, which also names kernels/) makes
kernels/ a namespace portion at most: a regular package named ``kernels`` anywhere on the path wins over it (the
Hugging Face kernels library, which transformers >= 5.25 imports), and alignaudit_kernels is this checkout's."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

PROBE = """
import os, sys
import alignaudit_kernels, kernels
print(os.path.abspath(sys.path[0] or "."))
print(kernels.__file__)
print(alignaudit_kernels.__file__)
"""


def test_the_root_first_on_sys_path_leaves_an_installed_kernels_package_in_place(tmp_path):
    site = tmp_path / "site"  # a regular package named kernels, as the Hugging Face library installs
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("")
    assert not (ROOT / "kernels" / "__init__.py").exists()
    # the root first (-c: the working directory), then what bench/gpu_run.sh exports, then the installed package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), str(site)])}
    lines = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert lines == [
        str(ROOT),
        str(site / "kernels" / "__init__.py"),
        str(ROOT / "kernels" / "alignaudit_kernels" / "__init__.py"),
    ]
