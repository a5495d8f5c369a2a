"""The bench scripts import this checkout through a folder of links (bench/checkout.py), never through its root,
whose kernels/ would shadow the Hugging Face ``kernels`` package that transformers >= 5.25 imports."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

from helpers import ROOT

_spec = importlib.util.spec_from_file_location("bench_checkout", ROOT / "bench" / "checkout.py")
checkout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkout)  # stdlib only; bench/ is not an installed package

# What a bench script sees after its first lines (bench/rl_steps.py's, run as `python bench/...`), and what a process
# it starts sees: where `kernels` and alignaudit come from.
PROBE = """
import importlib.util, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]).resolve().parent.parent))
from bench.checkout import use_this_checkout
use_this_checkout()
import alignaudit
spec = importlib.util.find_spec("kernels")
print(spec and spec.origin)
print(Path(alignaudit.__file__).resolve())
child = "import importlib.util; s = importlib.util.find_spec('kernels'); print(s and s.origin)"
print(subprocess.run([sys.executable, "-P", "-c", child], capture_output=True, text=True).stdout.strip())
print(subprocess.run([sys.executable, "-P", "-c", "import bench.timing as t; print(t.__file__)"],
                     capture_output=True, text=True).stdout.strip())
"""


def test_a_bench_script_and_its_children_import_this_checkout_but_not_its_kernels_as_kernels(tmp_path):
    script = ROOT / "bench" / "probe_not_committed.py"  # its own folder: the probe's sys.argv[1] stands in for it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    lines = subprocess.run([sys.executable, "-c", PROBE, str(script)], cwd=ROOT, env=env, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    ours = str(ROOT / "kernels" / "__init__.py")
    assert lines[0] != ours and lines[2] != ours  # the script's kernels, its child's
    assert lines[1] == str(ROOT / "alignaudit" / "__init__.py")
    assert os.path.realpath(lines[3]) == str(ROOT / "bench" / "timing.py")  # the child finds bench through the links
    plain = "import importlib.util; print(importlib.util.find_spec('kernels').origin)"  # without use_this_checkout
    assert subprocess.run([sys.executable, "-c", plain], cwd=ROOT, env=env, capture_output=True,
                          text=True).stdout.strip() == ours


def test_the_folder_holds_one_link_per_package_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = checkout.import_folder(ROOT)
    assert folder.parent == tmp_path
    assert sorted(p.name for p in folder.iterdir()) == sorted(checkout.PACKAGES)
    for name, source in checkout.PACKAGES.items():
        assert (folder / name).is_symlink() and (folder / name).resolve() == ROOT / source
    assert checkout.import_folder(ROOT) == folder


def test_a_folder_that_holds_something_else_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    taken = checkout.import_folder(ROOT)
    (taken / "alignaudit").unlink()
    (taken / "alignaudit").mkdir()  # not a link to this checkout: someone else's code could sit there
    folder = checkout.import_folder(ROOT)
    assert folder != taken and folder.parent == tmp_path
    assert (folder / "alignaudit").resolve() == ROOT / "alignaudit"
    (folder / "kernels").mkdir()  # anything besides the links: it would be importable too
    assert checkout.import_folder(ROOT) not in (folder, taken)
