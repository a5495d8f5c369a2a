"""`alignaudit rl` on the fixture: real Megatron-Core training, real vLLM rollouts, real weight syncs.

Chain of reasoning:
1. Strict kernels make the trainer's logprobs of the rollout's tokens bitwise equal to the rollout's own
   (tests/test_strict.py, rollout mode), for one set of weights.
2. After an optimizer step, the trainer's new weights reach the running rollout engine bit for bit: every
   tensor's sha256 matches, and vLLM's packed CPU GEMMs compute with the new weights (a probe against a
   GEMM packed afresh; its negative control injects stale packed weights and must be caught).
3. Therefore every step of a strict run must show 0 mismatching tokens while the weights change (a new
   weights digest every step); the default stack must mismatch at every step (negative control).
4. With lr 0 the weights never change and every step repeats the same rollout (same seeds): every
   statistic must be identical at every step, so any drift would be a sync or state bug.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pandas as pd
import psutil
import pytest

from alignaudit import cli
from alignaudit.errors import EXIT_ENGINE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE

from test_cli import one_line_error

TIMINGS = ["seconds", "rollout_s", "rescore_s", "update_s", "sync_s"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    for name, args in (("strict", ["--strict", "--steps", "3", "--lr", "1e-3"]),
                       ("default", ["--steps", "2", "--lr", "1e-3"]),
                       ("again", ["--steps", "2", "--lr", "1e-3"]),
                       ("control", ["--steps", "3", "--lr", "0"])):
        assert cli.main(["rl", *args, "--out", str(root / name)]) == EXIT_OK, name
    return root


def steps(runs, name):
    return pd.read_parquet(runs / name / "steps.parquet")


def test_strict_steps_stay_bitwise_aligned_while_the_weights_change(runs, tmp_path):
    s = steps(runs, "strict")
    assert s["step"].tolist() == [1, 2, 3] and (s["tokens"] == 4 * 4 * 16).all()
    assert (s["mismatches"] == 0).all() and (s["ulp_max"] == 0).all()
    assert (s["ratio_min"] == 1.0).all() and (s["ratio_max"] == 1.0).all() and (s["kl_k3"] == 0).all()
    assert s["sync_bit_equal"].all() and s["train_forward_equal"].all()
    assert s["weights_sha256"].nunique() == 3  # every step's update changed the weights
    assert (s["grad_norm"] > 0).all()
    record = json.loads((runs / "strict" / "run.json").read_text())
    assert record["status"] == "complete" and record["initial_sync"]["bit_equal"] and record["initial_sync"]["tensors"] == 25
    assert record["engines"]["train"]["optimizer"] == "alignaudit.rl.optim.MixedPrecisionAdam"
    assert len(pd.read_parquet(runs / "strict" / "tokens" / "step-00002.parquet")) == 256
    assert (runs / "strict" / "steps.png").stat().st_size > 10_000
    assert "0 of 3 steps with mismatching tokens" in (runs / "strict" / "report.html").read_text()
    out = tmp_path / "v"
    out.mkdir()
    args = ["--json", str(out / "v.json"), "--junit", str(out / "j.xml"), "--markdown", str(out / "s.md")]
    assert cli.main(["gate", str(runs / "strict"), *args]) == EXIT_OK
    suite = ET.fromstring((out / "j.xml").read_text())
    assert [c.get("name") for c in suite.findall("testcase")] == ["step 1", "step 2", "step 3"]


def test_the_default_stack_mismatches_at_every_step_and_fails_the_gate(runs, tmp_path):
    s = steps(runs, "default")
    assert (s["mismatches"] > 0).all() and (s["max_abs_diff"] > 1e-3).all() and s["sync_bit_equal"].all()
    out = tmp_path / "v"
    out.mkdir()
    args = ["--json", str(out / "v.json"), "--junit", str(out / "j.xml"), "--markdown", str(out / "s.md")]
    assert cli.main(["gate", str(runs / "default"), *args]) == EXIT_MISMATCH
    assert "2 of 2 steps have mismatching tokens" in json.loads((out / "v.json").read_text())["reasons"][0]


def test_lr_zero_repeats_every_step_exactly(runs):
    s = steps(runs, "control").drop(columns=TIMINGS + ["step"])
    first = s.iloc[0]
    for i in range(1, len(s)):
        assert s.iloc[i].equals(first), s.iloc[i].compare(first)
    record = json.loads((runs / "control" / "run.json").read_text())
    assert first["weights_sha256"] == record["initial_sync"]["weights_sha256"]  # the weights never moved


def test_the_same_seed_gives_the_same_run(runs):
    a, b = steps(runs, "default").drop(columns=TIMINGS), steps(runs, "again").drop(columns=TIMINGS)
    pd.testing.assert_frame_equal(a, b)
    assert a["weights_sha256"].iloc[-1] == b["weights_sha256"].iloc[-1]


def test_a_stale_weight_sync_is_caught(tmp_path):
    """Fault injection: vLLM's packed CPU GEMMs are not rebuilt after load_weights. The parameters (and so
    their checksums) hold the new weights, but the engine computes with the old ones: the probe catches it."""
    out = tmp_path / "stale"
    env = {**os.environ, "ALIGNAUDIT_FAULT": "stale-packed-weights"}
    proc = subprocess.run([sys.executable, "-m", "alignaudit", "rl", "--steps", "2", "--lr", "1e-3", "--out", str(out)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == EXIT_OK, proc.stderr
    s = pd.read_parquet(out / "steps.parquet")
    assert not s["sync_bit_equal"].any() and (s["sync_stale_packed"] > 0).all() and (s["sync_tensors_differing"] == 0).all()
    gate = subprocess.run([sys.executable, "-m", "alignaudit", "gate", str(out), "--max-mismatch", "100%"],
                          capture_output=True, text=True)
    assert gate.returncode == EXIT_MISMATCH and "weight sync was not bit-equal at 2 of 2 steps" in gate.stdout


def test_hf_trainer_with_vllm_rollout_strict(tmp_path):
    out = tmp_path / "hf"
    assert cli.main(["rl", "--train", "hf", "--infer", "vllm", "--strict", "--steps", "2", "--lr", "1e-3",
                     "--no-token-rows", "--out", str(out)]) == EXIT_OK
    s = pd.read_parquet(out / "steps.parquet")
    assert (s["mismatches"] == 0).all() and s["sync_bit_equal"].all() and s["weights_sha256"].nunique() == 2
    assert not (out / "tokens").exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0: run at least one step"),
    (["--group-size", "1"], "use 2 or more"),
    (["--lr", "-1"], "the learning rate must be >= 0"),
    (["--train", "vllm"], "rl trains with megatron or hf and rolls out with vllm or hf"),
    (["--random-prompts", "1", "--prompt-len", "1010", "--max-new-tokens", "16"], "plus 16 generated, longer than"),
])
def test_bad_input_is_refused_before_any_engine(capsys, tmp_path, argv, message):
    out = tmp_path / "o"
    assert message in one_line_error(capsys, ["rl", *argv, "--out", str(out)], EXIT_USAGE)
    assert not (out / "run.json").exists()


def test_an_engine_that_dies_mid_run_leaves_the_completed_steps(tmp_path):
    out = tmp_path / "dies"
    proc = subprocess.Popen([sys.executable, "-m", "alignaudit", "rl", "--steps", "50", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    deadline = time.time() + 120
    while not (out / "steps.parquet").exists() and time.time() < deadline:
        time.sleep(0.2)
    rollout = [c for c in psutil.Process(proc.pid).children(recursive=True) if "infer.request.json" in " ".join(c.cmdline())]
    rollout[0].send_signal(signal.SIGKILL)  # as the OOM killer would
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_ENGINE
    assert "vllm rollout worker died (exit code -9)" in err and "infer.log" in err and "Traceback" not in err
    done = pd.read_parquet(out / "steps.parquet")
    assert len(done) >= 1 and done["step"].tolist() == list(range(1, len(done) + 1))
    assert json.loads((out / "run.json").read_text())["status"] == "running"
