"""The capture worker's job (alignaudit.workers.job.CaptureJob): its record round-trips, a hand-edited request.json is
read or refused with the field named (exit 2, not a crash), and a capture reproduced from its request.json goes to a
new directory, never over the capture it came from."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from alignaudit.capture.ops import Selection
from alignaudit.errors import InputError
from alignaudit.inputs.request import EngineSettings, Sampling
from alignaudit.workers.job import CaptureJob, OpsRequest

WORKER = [sys.executable, "-m", "alignaudit.workers.capture_worker"]


def job_of(tiny_spec, tiny_batch, out, **kw) -> CaptureJob:
    return CaptureJob("hf", tiny_spec, EngineSettings(dtype="fp32"), tiny_batch, out.resolve(), **kw)


def test_a_job_round_trips_through_its_record(tiny_spec, tiny_batch, tmp_path):
    job = job_of(
        tiny_spec,
        tiny_batch,
        tmp_path,
        role="train",
        ops=OpsRequest(Selection(layers=frozenset({0}))),
        rollout=Sampling(max_new_tokens=4, group_size=2),
        repeat=2,
        routing_from=tmp_path / "r",
    )
    job.write(tmp_path / "request.json")
    assert CaptureJob.read(tmp_path / "request.json") == job


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("engine"), "engine: missing"),
        (lambda r: r["settings"].update(seed="zero"), "settings.seed 'zero': a int"),
        (lambda r: r["settings"].update(seed=True), "settings.seed True: a int"),
        (lambda r: r["settings"].update(dtype="fp8"), "settings.dtype 'fp8': one of bf16, fp16, fp32"),
        (lambda r: r["settings"].update(colour=1), "settings.colour: not a field of EngineSettings"),
        (lambda r: r["spec"].pop("num_layers"), "spec.num_layers: missing"),
        (lambda r: r["spec"].update(num_layers="2"), "spec.num_layers '2': a int"),
        (lambda r: r.update(repeat="2"), "repeat '2': a whole number >= 1"),
        (lambda r: r.update(batch="nope"), "not a capture job this alignaudit can read"),
    ],
)
def test_a_hand_edited_job_is_refused_naming_the_field(tiny_spec, tiny_batch, tmp_path, edit, message):
    path = tmp_path / "request.json"
    record = job_of(tiny_spec, tiny_batch, tmp_path).to_dict()
    edit(record)
    path.write_text(json.dumps(record))
    with pytest.raises(InputError, match="request.json: ") as refused:
        CaptureJob.read(path)
    assert message in str(refused.value)


def test_a_file_that_is_no_job_is_an_input_error(tmp_path):
    for text, message in (("[1]", "a JSON object, not list"), ("{", "not valid JSON")):
        (tmp_path / "r.json").write_text(text)
        with pytest.raises(InputError, match=message):
            CaptureJob.read(tmp_path / "r.json")
    with pytest.raises(InputError, match="cannot read the job"):
        CaptureJob.read(tmp_path / "missing.json")


@pytest.mark.engines
def test_a_capture_is_reproduced_into_a_new_directory_and_never_over_itself(tiny_spec, tiny_batch, tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    request = first / "request.json"
    job_of(tiny_spec, tiny_batch, first).write(request)
    assert subprocess.run([*WORKER, str(request)], capture_output=True).returncode == 0
    manifest = (first / "manifest.json").read_bytes()

    again = subprocess.run([*WORKER, str(request)], capture_output=True, text=True)
    assert again.returncode == 2 and "holds a capture already" in again.stderr
    assert (first / "manifest.json").read_bytes() == manifest  # the capture it came from is untouched

    second = tmp_path / "second"
    assert subprocess.run([*WORKER, str(request), "--out", str(second)], capture_output=True).returncode == 0
    a, b = pd.read_parquet(first / "logprobs.parquet"), pd.read_parquet(second / "logprobs.parquet")
    assert a["logprob"].map(float.hex).tolist() == b["logprob"].map(float.hex).tolist()

    usage = subprocess.run(WORKER, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: python -m alignaudit.workers.capture_worker" in usage.stderr
