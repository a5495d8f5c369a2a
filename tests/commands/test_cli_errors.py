"""Bad input and broken runs: one line, the documented exit code, nothing already written lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_ENGINE, EXIT_OK, EXIT_USAGE
from helpers import FIXTURE, one_line_error

pytestmark = pytest.mark.engines


def broken_model(tmp_path, edit):
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    edit(d)
    return str(d)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: (d / "config.json").write_text("[]"), "is not a JSON object"),
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
            "not a readable safetensors file",
        ),
        (
            lambda d: (d / "config.json").write_text(
                (d / "config.json").read_text().replace('"hidden_size": 128', '"hidden_size": 256')
            ),
            "has shape [512, 128], but config.json implies [512, 256]",
        ),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), "tokenizer.json is not valid JSON"),
        (lambda d: (d / "tokenizer_config.json").write_bytes(b"\xff\xfe"), "tokenizer_config.json is not valid JSON"),
        (lambda d: (d / "generation_config.json").write_text(""), "generation_config.json is not valid JSON"),
    ],
)
def test_broken_checkpoints_fail_before_any_engine(capsys, tmp_path, edit, message):
    model = broken_model(tmp_path, edit)
    assert message in one_line_error(capsys, ["compare", "--model", model, "--out", str(tmp_path / "o")], EXIT_USAGE)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--clip-eps", "-1"], "must lie in (0, 1)"),
        (["--seed", "-1"], "--seed -1: a seed lies in [0, 4294967295]"),
        (["--seed", str(2**32)], "--seed 4294967296: a seed lies in [0, 4294967295]"),
        (["--tis-threshold", "0"], "--tis-threshold 0.0: the truncation C must be a finite number > 0"),
        (
            ["--mask-low", "1.5", "--mask-high", "1.5"],
            "--mask-low 1.5 --mask-high 1.5: the kept range needs 0 <= low < high",
        ),
        (["--geo-mask-low", "1.01"], "--geo-mask-low 1.01 --geo-mask-high 1.001"),
        (["--prompt-len", "10"], "--prompt-len applies to --random-prompts"),
        (["--device", "cuda"], "sees no CUDA GPU"),
        (
            ["--random-prompts", "1", "--prompt-len", "1024"],
            "1024 tokens plus 1 generated, longer than the model's max length 1024",
        ),
        (["--mode", "rollout", "--random-prompts", "1", "--prompt-len", "1000"], "plus 32 generated"),
        (["--random-weights"], "--random-weights needs --model PRESET"),
        (["--strict", "softmax"], "unknown op(s) softmax"),
        (["--out", "/proc/alignaudit"], "cannot create --out"),
        (["--full-vocab", "--mode", "rollout"], "--full-vocab compares teacher-forced rows: in rollout mode"),
        (
            ["--full-vocab", "--infer-opt", "tensor_parallel_size=2"],
            "--full-vocab with vllm at tensor parallel size > 1 is not implemented",
        ),
        (["--mode", "rollout", "--top-k", "512"], "--top-k 512 keeps all 512 tokens of qwen3-tiny's vocabulary"),
    ],
)
def test_input_errors_before_any_engine(capsys, tmp_path, argv, message):
    argv = ["compare", *argv] + ([] if "--out" in argv else ["--out", str(tmp_path / "o")])
    assert message in one_line_error(capsys, argv, EXIT_USAGE)


@pytest.mark.parametrize(
    "argv", [["--debug", "diff", "nowhere-a", "nowhere-b"], ["diff", "nowhere-a", "nowhere-b", "--debug"]]
)
def test_debug_shows_the_traceback_before_or_after_the_command_name(capsys, argv):
    assert cli.main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.rstrip().endswith("error: nowhere-a is not a capture directory (it does not exist)")
    one_line_error(capsys, [a for a in argv if a != "--debug"], EXIT_USAGE)  # and none without it


@pytest.mark.parametrize(
    "command", [["rl"], ["capture", "--engine", "hf"], ["rescore", "rollouts.jsonl"], ["bisect"], ["ablate"]]
)
def test_a_seed_vllm_would_refuse_is_refused_by_every_command_before_any_engine(capsys, tmp_path, command):
    err = one_line_error(capsys, [*command, "--seed", "-3", "--out", str(tmp_path / "o")], EXIT_USAGE)
    assert "--seed -3: a seed lies in [0, 4294967295]" in err and not (tmp_path / "o").exists()


def test_bad_engine_settings_are_input_errors(capsys, tmp_path):
    base = ["compare", "--train", "hf", "--infer", "hf"]
    err = one_line_error(
        capsys, [*base, "--train-opt", "micro_batch_size=abc", "--out", str(tmp_path / "a")], EXIT_USAGE
    )
    assert "micro_batch_size='abc': expected an integer >= 1" in err
    err = one_line_error(
        capsys,
        [*base, "--train-opt", "attn_implementation=flash_attention_2", "--out", str(tmp_path / "b")],
        EXIT_USAGE,
    )
    assert "transformers cannot load qwen3-tiny with attn_implementation=flash_attention_2" in err
    err = one_line_error(
        capsys,
        [
            "compare",
            "--train",
            "megatron",
            "--infer",
            "hf",
            "--train-opt",
            "num_layers=5",
            "--out",
            str(tmp_path / "c"),
        ],
        EXIT_USAGE,
    )
    assert "num_layers come from the checkpoint" in err


def test_failed_recapture_leaves_no_valid_looking_capture(capsys, tmp_path):
    cap = tmp_path / "cap"
    assert cli.main(["capture", "--engine", "hf", "--no-ops", "--out", str(cap)]) == EXIT_OK
    manifest = (cap / "manifest.json").read_bytes()
    # refused before anything starts: the earlier capture is left as it was
    assert one_line_error(
        capsys, ["capture", "--engine", "hf", "--opt", "micro_batch_size=0", "--out", str(cap), "--force"], EXIT_USAGE
    )
    assert (cap / "manifest.json").read_bytes() == manifest
    # failed inside the engine: the earlier capture must not look like this run's
    assert one_line_error(
        capsys,
        ["capture", "--engine", "hf", "--opt", "attn_implementation=flash_attention_2", "--out", str(cap), "--force"],
        EXIT_USAGE,
    )
    assert not (cap / "manifest.json").exists()
    err = one_line_error(capsys, ["diff", str(cap), str(cap), "--out", str(tmp_path / "d")], EXIT_USAGE)
    assert "incomplete" in err
    err = one_line_error(
        capsys, ["capture", "--engine", "hf", "--reference", str(cap), "--out", str(cap), "--force"], EXIT_USAGE
    )
    assert "overlaps the input" in err


def test_damaged_op_captures_are_errors_not_differences(capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, seed in ((a, "0"), (b, "1")):  # two requests (the suite memoizes a request's capture); b is damaged
        assert (
            cli.main(["capture", "--engine", "hf", "--layers", "0", "--ops", "attn", "--seed", seed, "--out", str(out)])
            == EXIT_OK
        )
    chunk = next((b / "ops").glob("chunk-*.safetensors"))
    data = bytearray(chunk.read_bytes())
    data[-10] ^= 0x01  # one bit in the last tensor's data
    chunk.write_bytes(bytes(data))
    err = one_line_error(capsys, ["diff", str(a), str(b), "--out", str(tmp_path / "d1")], EXIT_USAGE)
    assert "does not match its sha256 fingerprint" in err
    assert not (tmp_path / "d1").exists()  # refused before writing anything
    (b / "ops" / "index.parquet").write_bytes(b"PAR1 truncated")
    err = one_line_error(capsys, ["diff", str(a), str(b), "--out", str(tmp_path / "d2")], EXIT_USAGE)
    assert "index.parquet is missing or is not the file the capture wrote" in err
    assert "is a file" in one_line_error(
        capsys, ["diff", str(chunk), str(a), "--out", str(tmp_path / "d3")], EXIT_USAGE
    )


def _wait_for_worker(proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        workers = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "alignaudit.workers.capture_worker" in " ".join(c.cmdline())
        ]
        if workers:
            return workers[0]
        time.sleep(0.2)
    raise AssertionError("no worker started")


def test_sigterm_stops_the_worker_too(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "alignaudit", "compare", "--train", "hf", "--infer", "hf", "--out", str(tmp_path / "o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    worker = _wait_for_worker(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 130
    worker.wait(timeout=10)  # raises psutil.TimeoutExpired if the worker outlived its parent
    assert (tmp_path / "o" / "run.json").is_file()


def test_killed_worker_is_reported_with_its_last_lines(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "alignaudit", "compare", "--train", "hf", "--infer", "hf", "--out", str(tmp_path / "o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    _wait_for_worker(proc).kill()  # as the OOM killer would
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_ENGINE
    assert "hf worker crashed (exit code -9)" in err and "worker.log" in err and "Traceback" not in err
    assert json.loads((tmp_path / "o" / "run.json").read_text())["train"]["engine"] == "hf"
