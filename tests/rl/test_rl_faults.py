"""`alignaudit rl` when something goes wrong, each test on a run of its own: a stale weight sync (fault injection:
vLLM's packed CPU GEMMs not rebuilt after the load) is caught, bad input is refused before any engine starts, an
engine that dies mid-run leaves the completed steps, and a run cut while its engines shut down stays finished. The
runs that the checks of a finished run share are in test_rl.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import psutil
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_ENGINE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE
from helpers import one_line_error, run_in_process, vllm_packs_cpu_weights

pytestmark = [pytest.mark.engines, pytest.mark.long]


def test_a_stale_weight_sync_is_caught(tmp_path, capsys, monkeypatch):
    """Fault injection: vLLM's packed CPU GEMMs are not rebuilt after load_weights. The parameters (and so
    their checksums) hold the new weights, but the engine computes with the old ones: the probe catches it."""
    if not vllm_packs_cpu_weights():
        pytest.skip("vLLM's CPU GEMM computes with the live weight on this CPU (no packed copy to go stale)")
    out = tmp_path / "stale"
    env = {**os.environ, "ALIGNAUDIT_FAULT": "stale-packed-weights"}
    proc = subprocess.run(
        [sys.executable, "-m", "alignaudit", "rl", "--steps", "2", "--lr", "1e-3", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    s = pd.read_parquet(out / "steps.parquet")
    assert (
        not s["sync_bit_equal"].any()
        and (s["sync_stale_packed"] > 0).all()
        and (s["sync_tensors_differing"] == 0).all()
    )
    gate = run_in_process(capsys, monkeypatch, "gate", str(out), "--max-mismatch", "100%")
    assert gate.returncode == EXIT_MISMATCH and "weight sync was not bit-equal at 2 of 2 steps" in gate.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps 0: run at least one step"),
        (["--max-seconds", "-1"], "--max-seconds -1: a time in seconds, finite and >= 0 (0: no limit)"),
        (["--max-seconds", "nan"], "--max-seconds nan: a time in seconds"),
        (["--group-size", "1"], "use 2 or more"),
        (["--lr", "-1"], "the learning rate must be finite and >= 0"),
        (["--train", "vllm"], "rl trains with hf or megatron and rolls out with hf or vllm"),
        (["--random-prompts", "1", "--prompt-len", "1010", "--max-new-tokens", "16"], "plus 16 generated, longer than"),
        (["--tis-threshold", "-2"], "--tis-threshold -2.0: the truncation C must be a finite number > 0"),
        (["--mask-low", "5", "--mask-high", "0.5"], "the kept range needs 0 <= low < high"),
        (["--log-to", "tensorboard,mlflow"], "--log-to mlflow: not an export; choose from tensorboard, wandb"),
        (["--keep-vocab-rows"], "--keep-vocab-rows keeps the rows --full-vocab records; add --full-vocab"),
        (
            ["--full-vocab", "--train-opt", "tensor_model_parallel_size=2"],
            "rl --full-vocab with megatron at tensor parallel size > 1 is not implemented",
        ),
        (
            ["--full-vocab", "--infer-opt", "logprobs_mode=processed_logprobs"],
            "rl --full-vocab with logprobs_mode=processed_logprobs is not built yet",
        ),
        (["--sleep-level", "1"], "--sleep-level needs --device cuda: vLLM's sleep mode frees GPU memory"),
        (["--sleep-level", "1", "--infer", "hf"], "--sleep-level: hf does not sleep; use --infer vllm"),
        (["--sleep-level", "2"], "--sleep-level 2: 1 (weights to host memory, KV cache freed) or 0"),
        (["--reward", "task", "--ignore-eos"], "--reward task scores answers that end at EOS"),
        (["--reward", "task", "--infer", "hf"], "--reward task scores answers that end at EOS"),
        (["--reward", "task", "--random-prompts", "2"], "--reward task scores addition questions such as '37+45='"),
        (["--full-vocab", "--engine-mode", "async"], "rl --full-vocab with --engine-mode async is not built"),
        (["--engine-mode", "async", "--infer", "hf"], "--engine-mode"),
        (["--arrival-gap", "0.1"], "--arrival-gap spaces the arrivals of --engine-mode async"),
    ],
)
def test_bad_input_is_refused_before_any_engine(capsys, tmp_path, argv, message):
    out = tmp_path / "o"
    assert message in one_line_error(capsys, ["rl", *argv, "--out", str(out)], EXIT_USAGE)
    assert not (out / "run.json").exists()


def test_a_missing_export_library_is_refused_with_the_pip_command(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` sees without the package
    out = tmp_path / "o"
    err = one_line_error(capsys, ["rl", "--log-to", "wandb,tensorboard", "--out", str(out)], EXIT_USAGE)
    assert "--log-to tensorboard: the tensorboard package is not installed; run `pip install tensorboard`" in err
    assert not out.exists()


def test_an_engine_that_dies_mid_run_leaves_the_completed_steps(tmp_path):
    out = tmp_path / "dies"
    proc = subprocess.Popen(
        [sys.executable, "-m", "alignaudit", "rl", "--steps", "50", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    deadline = time.time() + 120
    while not (out / "steps.parquet").exists() and time.time() < deadline:
        time.sleep(0.2)
    rollout = [
        c for c in psutil.Process(proc.pid).children(recursive=True) if "infer.request.json" in " ".join(c.cmdline())
    ]
    rollout[0].send_signal(signal.SIGKILL)  # as the OOM killer would
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_ENGINE
    assert "vllm rollout worker died (exit code -9)" in err and "infer.log" in err and "Traceback" not in err
    done = pd.read_parquet(out / "steps.parquet")
    assert len(done) >= 1 and done["step"].tolist() == list(range(1, len(done) + 1))
    record = json.loads((out / "run.json").read_text())  # never left looking as if it still ran
    assert record["status"] == "failed" and record["error"].startswith("EngineError: vllm rollout worker died")


def test_a_run_cut_while_its_engines_shut_down_stays_finished(tmp_path, monkeypatch):
    from alignaudit.commands.interrupts import EXIT_INTERRUPTED

    """A deadline that lands while the engines shut down (Ctrl-C or `timeout`'s SIGTERM after the last step): the run
    was sealed before the shutdown, so run.json says complete with every step, and the gate reads it."""
    from alignaudit.workers.session import Session

    close = Session.close

    def close_then_interrupt(self):
        close(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "close", close_then_interrupt)
    out = tmp_path / "cut"
    assert (
        cli.main(["rl", "--train", "hf", "--infer", "hf", "--steps", "2", "--strict", "--out", str(out)])
        == EXIT_INTERRUPTED
    )
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "complete" and record["steps_run"] == 2
    monkeypatch.undo()
    assert cli.main(["gate", str(out), "--json", str(tmp_path / "v.json")]) == EXIT_OK
