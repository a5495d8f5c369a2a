"""Engine workers start without the working directory on sys.path (alignaudit.workers.spawn.python_module): run from
this checkout, its kernels/ would shadow the Hugging Face ``kernels`` package that transformers >= 5.25 imports."""

from __future__ import annotations

import os
import subprocess
import sys

from alignaudit.workers import spawn
from helpers import ROOT

PROBE = "import importlib.util; spec = importlib.util.find_spec('kernels'); print(spec and spec.origin)"


def _kernels_seen_by(command: list[str], tmp_path) -> str:
    (tmp_path / "probe_kernels.py").write_text(PROBE + "\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_a_worker_started_in_the_checkout_does_not_import_its_kernels_as_kernels(tmp_path):
    ours = str(ROOT / "kernels" / "__init__.py")
    assert _kernels_seen_by([sys.executable, "-m", "probe_kernels"], tmp_path) == ours  # what python -m alone does
    assert _kernels_seen_by(spawn.python_module("probe_kernels"), tmp_path) != ours


def test_the_worker_keeps_the_working_directory_where_it_alone_gives_this_alignaudit(monkeypatch):
    import alignaudit

    plain = [sys.executable, "-m", "alignaudit.workers.capture_worker"]
    assert spawn.python_module("alignaudit.workers.capture_worker") == [
        sys.executable, "-P", "-m", "alignaudit.workers.capture_worker"]  # the suite's editable install
    # run in one checkout while installed from another: -P would import the other one in the worker
    monkeypatch.setattr(alignaudit, "__file__", "/elsewhere/alignaudit/__init__.py")
    assert spawn.python_module("alignaudit.workers.capture_worker") == plain
    monkeypatch.undo()
    monkeypatch.setattr(sys, "meta_path", [])  # not installed: nothing but the working directory finds it
    assert spawn.python_module("alignaudit.workers.capture_worker") == plain
