"""Engine workers start without the working directory on sys.path where that still imports this process's alignaudit
(alignaudit.workers.spawn.python_module): started inside another checkout of alignaudit, ``python -m`` alone would
import that checkout's code in the worker."""

from __future__ import annotations

import os
import subprocess
import sys

from alignaudit.workers import spawn

PROBE = "import alignaudit; print(alignaudit.__file__)"


def test_a_worker_started_in_another_checkout_imports_this_alignaudit(tmp_path):
    import alignaudit

    other = tmp_path / "other"  # another checkout's root: its own alignaudit/
    (other / "alignaudit").mkdir(parents=True)
    (other / "alignaudit" / "__init__.py").write_text("")
    (tmp_path / "probe_alignaudit.py").write_text(PROBE + "\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def seen_by(command: list[str]) -> str:
        return subprocess.run(command, cwd=other, env=env, capture_output=True, text=True, check=True).stdout.strip()

    assert seen_by([sys.executable, "-m", "probe_alignaudit"]) == str(other / "alignaudit" / "__init__.py")
    assert seen_by(spawn.python_module("probe_alignaudit")) == alignaudit.__file__


def test_the_worker_keeps_the_working_directory_where_it_alone_gives_this_alignaudit(monkeypatch):
    import alignaudit

    plain = [sys.executable, "-m", "alignaudit.workers.capture_worker"]
    assert spawn.python_module("alignaudit.workers.capture_worker") == [
        sys.executable,
        "-P",
        "-m",
        "alignaudit.workers.capture_worker",
    ]  # the suite's editable install
    # run in one checkout while installed from another: -P would import the other one in the worker
    monkeypatch.setattr(alignaudit, "__file__", "/elsewhere/alignaudit/__init__.py")
    assert spawn.python_module("alignaudit.workers.capture_worker") == plain
    monkeypatch.undo()
    monkeypatch.setattr(sys, "meta_path", [])  # not installed: nothing but the working directory finds it
    assert spawn.python_module("alignaudit.workers.capture_worker") == plain
