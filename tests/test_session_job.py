"""The RL session worker's job (alignaudit.workers.job.SessionJob): its record round-trips, a request file that is
not one is refused with the field named, and a worker given such a file answers every command with that refusal
instead of dying."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from alignaudit.errors import InputError
from alignaudit.inputs.request import EngineSettings
from alignaudit.workers.job import SessionJob
from alignaudit.workers.session import REPLY_MARKER


def test_a_session_job_round_trips_through_its_record(tiny_spec, tmp_path):
    job = SessionJob("trainer", "hf", tiny_spec, EngineSettings(dtype="fp32"), 1e-3, 1.0, 0.25, 0.04)
    job.write(tmp_path / "train.request.json")
    assert SessionJob.read(tmp_path / "train.request.json") == job


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("role"), "role: missing"),
        (lambda r: r.update(role="critic"), "role 'critic': one of trainer, rollout"),
        (lambda r: r.update(lr="1e-3"), "lr '1e-3': a float"),
        (lambda r: r.update(kl_coef=True), "kl_coef True: a float"),
        (lambda r: r.update(offload_fraction=1.5), r"offload_fraction 1.5: a fraction in \[0, 1\]"),
        (lambda r: r.update(momentum=0.9), "momentum: not a field of SessionJob"),
        (lambda r: r["settings"].update(dtype=7), "settings.dtype 7: a str"),
        (lambda r: r["settings"].update(dtype="int8"), "settings.dtype 'int8': one of "),
        (lambda r: r.update(spec=[]), "spec: a JSON object, not list"),
    ],
)
def test_a_request_that_is_not_a_session_job_is_refused_naming_the_field(tiny_spec, tmp_path, change, message):
    path = tmp_path / "infer.request.json"
    SessionJob("rollout", "hf", tiny_spec, EngineSettings()).write(path)
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))
    with pytest.raises(InputError, match=rf"^{path}: {message}"):
        SessionJob.read(path)


def test_a_worker_given_a_bad_job_answers_with_the_refusal_and_closes(tmp_path):
    path = tmp_path / "infer.request.json"
    path.write_text('{"role": "rollout"}')
    proc = subprocess.run(
        [sys.executable, "-m", "alignaudit.workers.rl_session", str(path)],
        input='{"command": "settings"}\n{"command": "close"}\n',
        capture_output=True,
        text=True,
        timeout=120,
    )
    replies = [json.loads(line[len(REPLY_MARKER) :]) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(replies) == 3 and replies[-1] == {}
    assert replies[0]["error"] == {"type": "InputError", "message": f"{path}: engine: missing"}
    assert replies[1]["error"]["message"] == "the worker failed to start; see its log"
