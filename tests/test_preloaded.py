"""The test session's worker launcher (alignaudit.workers.preloaded): a worker forked from a preloaded server
answers as a fresh ``python -m alignaudit.workers.capture_worker`` does; a launch under another environment gets
a server of its own, and one past the cap a fresh process."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from alignaudit.errors import InputError
from alignaudit.inputs.request import EngineRun, EngineSettings
from alignaudit.workers import preloaded, spawn

pytestmark = pytest.mark.engines


def test_the_engines_a_launch_imports(tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"engine": "vllm"}))
    assert preloaded.engines_of([str(request)]) == ("vllm",)
    checks = [{"engine": "vllm"}, {"engine": "megatron"}, {"engine": "vllm"}]
    assert preloaded.engines_of(["--check-options", json.dumps(checks)]) == ("megatron", "vllm")
    assert preloaded.engines_of([str(tmp_path / "missing.json")]) is None


def test_a_forked_worker_answers_as_a_fresh_one(tiny_spec, monkeypatch):
    """The option check of megatron, refused and accepted, through a fresh process and through the server: the
    same error (type and message, read from the worker's output and exit code) and the same success."""
    fresh = spawn.start_worker
    while isinstance(getattr(fresh, "__self__", None), preloaded.Preloaded):  # the session's pool: its fallback
        fresh = fresh.__self__.fresh
    pool = preloaded.Preloaded(fresh)
    launched = []
    try:
        for launcher in (fresh, pool.start_worker):
            monkeypatch.setattr(
                spawn,
                "start_worker",
                lambda args, env, launch=launcher: launched.append(launch(args, env)) or launched[-1],
            )
            with pytest.raises(InputError) as refused:
                spawn.check_options([EngineRun("megatron", EngineSettings(options={"bogus_option": 1}))], tiny_spec)
            spawn.check_options([EngineRun("megatron", EngineSettings(options={"micro_batch_size": 2}))], tiny_spec)
            launched.append(str(refused.value))
        fresh_refusal, forked_refusal = launched[2], launched[5]
        assert fresh_refusal == forked_refusal and "bogus_option" in fresh_refusal
        assert all(isinstance(p, subprocess.Popen) for p in launched[:2])
        assert all(isinstance(p, preloaded.ForkedWorker) for p in launched[3:5])
        assert [p.returncode for p in launched[:2] + launched[3:5]] == [2, 0, 2, 0]
        server = next(iter(pool.servers.values())).proc.pid
        assert server not in {p.pid for p in launched[3:5]} and launched[3].pid != launched[4].pid
        # W&B's service socket (what `rl --log-to wandb` leaves in the environment) does not make another server
        check = json.dumps([{"engine": "megatron"}])
        same = pool.start_worker(["--check-options", check], {**os.environ, "WANDB_SERVICE": "3-1-unix-/tmp/s"})
        same.wait()
        assert isinstance(same, preloaded.ForkedWorker) and len(pool.servers) == 1
        # another environment (a variable the server imported without): a server of its own; none past the cap
        other = pool.start_worker(["--check-options", check], {**os.environ, "ALIGNAUDIT_TEST_OTHER_ENV": "1"})
        other.wait()
        assert isinstance(other, preloaded.ForkedWorker) and len(pool.servers) == 2
        pool.max_servers = 2
        third = pool.start_worker(["--check-options", check], {**os.environ, "ALIGNAUDIT_TEST_OTHER_ENV": "2"})
        third.wait()
        assert isinstance(third, subprocess.Popen) and len(pool.servers) == 2
    finally:
        pool.close()


def test_a_forked_rl_session_answers_as_a_fresh_one(tiny_spec, monkeypatch, tmp_path):
    """The RL loop's long-lived worker (alignaudit.workers.rl_session) of an hf rollout engine, started fresh and
    forked: the same settings record (less its start-up seconds), the same refusal of an unknown command (type and
    message, through stdin and stdout), exit code 0 after ``close``; the forked one's stderr goes to its log."""
    from alignaudit.inputs.request import EngineSettings as Settings
    from alignaudit.workers.job import SessionJob
    from alignaudit.workers.rl_session import Worker
    from alignaudit.workers.session import Session

    fresh_session = spawn.start_session
    while isinstance(getattr(fresh_session, "__self__", None), preloaded.Preloaded):
        fresh_session = fresh_session.__self__.fresh_session
    pool = preloaded.Preloaded(spawn.start_worker, fresh_session=fresh_session)
    job = SessionJob("rollout", "hf", tiny_spec, Settings())
    records, refusals, procs = [], [], []
    try:
        for name, launcher in (("fresh", fresh_session), ("forked", pool.start_session)):
            monkeypatch.setattr(spawn, "start_session", launcher)
            session = Session(job, tmp_path / f"{name}.log")
            procs.append(session.proc)
            record = session.call("settings")["settings"]
            record.pop("worker_startup_s")
            records.append(record)
            with pytest.raises(InputError) as refused:
                session.call("no-such-command")
            refusals.append(str(refused.value))
            session.close()
        assert records[0] == records[1] and records[0]["engine"] == "hf"
        known = ", ".join(Worker.COMMANDS)
        assert "export" in known and "load_weights" in known
        assert refusals[0] == refusals[1] == f"unknown session command 'no-such-command'; known: {known}"
        assert isinstance(procs[0], subprocess.Popen) and isinstance(procs[1], preloaded.ForkedWorker)
        assert [p.returncode for p in procs] == [0, 0]
        assert "InputError" in (tmp_path / "forked.log").read_text()  # the worker's traceback, on its stderr
    finally:
        pool.close()
