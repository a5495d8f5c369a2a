"""`alignaudit rl` on the fixture: real Megatron-Core training, real vLLM rollouts, real weight syncs.

Chain of reasoning:
1. Strict kernels make the trainer's logprobs of the rollout's tokens bitwise equal to the rollout's own
   (tests/engines/test_strict.py, rollout mode), for one set of weights.
2. After an optimizer step, the trainer's new weights reach the running rollout engine bit for bit: every
   tensor's sha256 matches, and vLLM's packed CPU GEMMs compute with the new weights (a probe against a
   GEMM packed afresh; its negative control injects stale packed weights and must be caught: test_rl_faults.py).
3. Therefore every step of a strict run must show 0 mismatching tokens while the weights change (a new
   weights digest every step); the default stack must mismatch at every step (negative control).
4. With lr 0 the weights never change and every step repeats the same rollout (same seeds): every
   statistic must be identical at every step, so any drift would be a sync or state bug. That run samples as
   frameworks do, rl's default: a group as one request (n = G), EOS ending completions.

Those runs are made once for this file (the `runs` fixture); the tests that start runs of their own are in
test_rl_engine_setups.py (HF training, async rollouts) and test_rl_faults.py (faults and refused input).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_ENGINE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE
from helpers import importance_by_hand, one_line_error

pytestmark = [pytest.mark.engines, pytest.mark.long]

TIMINGS = ["seconds", "rollout_s", "rescore_s", "update_s", "optimizer_s", "sync_s", "vocab_s"]
# IS thresholds close to 1, so that the default stack's mismatch truncates and masks some tokens
IS_OPTIONS = ["--tis-threshold", "1.0001", "--mask-low", "0.9999", "--mask-high", "1.001"]
IS_HAND = dict(tis=1.0001, mask_low=0.9999, mask_high=1.001)


class TenSecondsACall:
    """rl.loop's clock for --max-seconds: 0 at the run's start, then 10 s more at every reading (one after each
    step)."""

    def __init__(self):
        self.now = -10.0

    def monotonic(self) -> float:
        self.now += 10.0
        return self.now

    perf_counter = staticmethod(time.perf_counter)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    vocab = ["--full-vocab", "--keep-vocab-rows", "--ignore-eos"]  # fixed lengths: 4 x 4 x 16 tokens a step
    for name, args in (
        ("strict", ["--strict", "--steps", "3", "--lr", "1e-3", "--kl-coef", "0.04", *vocab]),
        ("default", ["--steps", "2", "--lr", "1e-3", *IS_OPTIONS, "--log-to", "tensorboard", *vocab]),
        # 3 steps asked, stopped by --max-seconds after step 2 (20 s on TenSecondsACall): "default" again
        (
            "again",
            [
                "--steps",
                "3",
                "--max-seconds",
                "15",
                "--lr",
                "1e-3",
                *IS_OPTIONS,
                "--log-to",
                "wandb",
                "--full-vocab",
                "--ignore-eos",
            ],
        ),
        # processed logprobs at temperature 1 (no truncation): raw sampling, replayed by the trainer
        ("control", ["--steps", "3", "--lr", "0", "--infer-opt", "logprobs_mode=processed_logprobs"]),
    ):
        printed = io.StringIO()  # not a terminal, as a CI log: the progress bar draws once, the step lines stay
        with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as patch:
            patch.setattr("alignaudit.rl.loop.time", TenSecondsACall())
            assert cli.main(["rl", *args, "--out", str(root / name)]) == EXIT_OK, name
        (root / f"{name}.stdout").write_text(printed.getvalue())
    return root


def test_every_step_prints_one_whole_line_outside_a_terminal(runs):
    """The step lines lead with what the mismatch costs (tokens differing, max |d|, KL, clip), one per step, whole
    (not cut to the terminal width), their numbers those of steps.parquet."""
    for name in ("strict", "default"):
        s = steps(runs, name)
        lines = [line for line in (runs / f"{name}.stdout").read_text().splitlines() if line.startswith("step ")]
        assert len(lines) == len(s), (name, lines)
        for line, row in zip(lines, s.itertuples(), strict=True):
            assert line.startswith(f"step {row.step}: {row.mismatches}/{row.tokens} tokens differ, max |d| "), line
            assert f", clip {row.clip_fraction:.3f}, sync ok, reward {row.reward_mean:.3f}, " in line, line
            assert f", vocab KL {row.vocab_kl_train_infer_mean:.2e}, top-1 {row.vocab_top1_agreement:.3f}, " in line, (
                line
            )


def steps(runs, name):
    return pd.read_parquet(runs / name / "steps.parquet")


def test_strict_steps_stay_bitwise_aligned_while_the_weights_change(runs, tmp_path):
    s = steps(runs, "strict")
    assert s["step"].tolist() == [1, 2, 3] and (s["tokens"] == 4 * 4 * 16).all()
    assert (s["mismatches"] == 0).all() and (s["ulp_max"] == 0).all()
    assert (s["ratio_min"] == 1.0).all() and (s["ratio_max"] == 1.0).all() and (s["kl_k3"] == 0).all()
    assert (s["prob_diff_max"] == 0).all() and (s["prob_diff_mean"] == 0).all()
    for key in (
        "token_ratio_min",
        "token_ratio_max",
        "seq_ratio_min",
        "seq_ratio_max",
        "geo_ratio_min",
        "geo_ratio_max",
        "token_tis_weight_mean",
        "seq_tis_weight_mean",
        "token_ess",
        "seq_ess",
    ):
        assert (s[f"is_{key}"] == 1.0).all(), key
    zero = [c for c in s if c.startswith(("is_kl", "is_chi2")) or (c.startswith("is_") and "fraction" in c)]
    assert len(zero) == 17 and (s[zero] == 0.0).all().all()
    assert s["sync_bit_equal"].all() and s["train_forward_equal"].all()
    assert s["weights_digest"].nunique() == 3  # every step's update changed the weights
    assert (s["grad_norm"] > 0).all() and (s["weights_changed"] > 0).all() and (s["max_abs_dw"] > 0).all()
    assert (s["weights_changed_fraction"] == s["weights_changed"] / 525056).all()  # the fixture's weight elements
    # the KL term's reference is the starting weights: exactly 0 at step 1, then > 0; swapping the reference in
    # and out for its logprobs leaves the trainer's weights as they were (train_forward_equal above)
    assert s["kl_ref"].iloc[0] == 0.0 and (s["kl_ref"].iloc[1:] > 0).all()
    assert "kl_ref" not in steps(runs, "default")
    record = json.loads((runs / "strict" / "run.json").read_text())
    # --full-vocab: one request per completion (rows are per request); --ignore-eos: every completion 16 tokens
    assert (record["rollout"]["group_size"], record["rollout"]["stop_at_eos"]) == (1, False)
    assert (s["completions_ended_early"] == 0).all() and (s["completion_len_min"] == 16).all()
    assert (
        record["status"] == "complete"
        and record["initial_sync"]["bit_equal"]
        and record["initial_sync"]["tensors"] == 25
    )
    assert record["engines"]["train"]["optimizer"] == "alignaudit.training.optim.MixedPrecisionAdam"
    assert record["engines"]["train"]["strict_backward"] == "reference"  # unset: auto, the reference on the CPU
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
    assert (s["prob_diff_max"] > 0).all() and (s["prob_diff_max"] >= s["prob_diff_mean"]).all()
    record = json.loads((runs / "default" / "run.json").read_text())
    assert record["importance"]["tis"] == 1.0001 and record["importance"]["mask_high"] == 1.001
    for row in s.to_dict("records"):  # each step's IS numbers, recomputed by hand from its token rows
        tokens = pd.read_parquet(runs / "default" / "tokens" / f"step-{row['step']:05d}.parquet")
        hand = importance_by_hand(tokens, **IS_HAND)
        assert hand["tokens"] == row["tokens"] == 256 and hand["sequences"] == 16
        for key, value in hand.items():
            if key not in ("tokens", "sequences"):
                assert row[f"is_{key}"] == pytest.approx(value, rel=1e-9, abs=1e-15), (row["step"], key)
        assert row["is_token_ratio_max"] > 1 > row["is_token_ratio_min"] and row["is_kl_k3"] > 0
        assert 0 < row["is_token_tis_fraction"] < 1 and 0 < row["is_token_mask_fraction"] < 1
        assert row["is_geo_mask_fraction"] > 0 and row["is_token_ess"] < 1
    out = tmp_path / "v"
    out.mkdir()
    args = ["--json", str(out / "v.json"), "--junit", str(out / "j.xml"), "--markdown", str(out / "s.md")]
    assert cli.main(["gate", str(runs / "default"), *args]) == EXIT_MISMATCH
    assert "2 of 2 steps have mismatching tokens" in json.loads((out / "v.json").read_text())["reasons"][0]


def _rows(run, step):
    """The step's kept rows (--keep-vocab-rows), float32 [tokens, V] per side, read with safetensors alone."""
    from safetensors.numpy import load_file

    return [load_file(run / "vocab" / f"step-{step:05d}-{side}.safetensors")["logprobs"] for side in ("train", "infer")]


def _by_hand(a32, b32):
    """Per position, in numpy float64 from the fp32 rows: KL both ways, TV, top-1 agreement and top-5 overlap of the
    two renormalized distributions (ties to the lower token id)."""

    def normalized(x):
        x = x.astype(np.float64)
        top = x.max(axis=1, keepdims=True)
        return x - (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))

    la, lb = normalized(a32), normalized(b32)
    p, q = np.exp(la), np.exp(lb)
    top_a = np.argsort(-a32, axis=1, kind="stable")[:, :5]
    top_b = np.argsort(-b32, axis=1, kind="stable")[:, :5]
    overlap = np.array([len(set(x) & set(y)) / 5 for x, y in zip(top_a, top_b, strict=True)])
    return {
        "vocab_kl_train_infer": (p * (la - lb)).sum(axis=1),
        "vocab_kl_infer_train": (q * (lb - la)).sum(axis=1),
        "vocab_tv": 0.5 * np.abs(p - q).sum(axis=1),
        "vocab_top1_agree": a32.argmax(1) == b32.argmax(1),
        "vocab_topk_overlap": overlap,
    }


def test_full_vocab_columns_are_those_of_the_rows_by_hand(runs):
    """--full-vocab: each step's kept rows (trainer: its rescoring forward; rollout: vLLM's sampler while decoding)
    hold, bit for bit, the logprob each engine recorded at the token; the per-token and per-step vocab columns
    equal a float64 computation from those rows by hand. Default stack: KL > 0 at every generated token; strict:
    the rows are bit-equal, so KL = TV = 0 exactly and top-1 = top-5 = 1. Without --keep-vocab-rows no row is
    left in the run directory."""
    vocab = 512  # the fixture's vocabulary
    for name in ("default", "strict"):
        s = steps(runs, name)
        for row in s.to_dict("records"):
            step = row["step"]
            tokens = pd.read_parquet(runs / name / "tokens" / f"step-{step:05d}.parquet")
            a, b = _rows(runs / name, step)
            assert a.shape == b.shape == (len(tokens), vocab) == (256, vocab) and a.dtype == np.float32
            ids = tokens["token_id"].to_numpy()
            for rows, side in ((a, "train"), (b, "infer")):
                picked = rows[np.arange(len(ids)), ids]
                assert np.array_equal(picked.view(np.int32), tokens[f"lp_{side}"].to_numpy(np.float32).view(np.int32))
                assert tokens[f"vocab_row_matches_{side}"].all()
            hand = _by_hand(a, b)
            for column, values in hand.items():
                np.testing.assert_allclose(
                    tokens[column].to_numpy(dtype=np.float64),
                    values.astype(np.float64),
                    rtol=1e-9,
                    atol=1e-15,
                    err_msg=f"{name} step {step} {column}",
                )
            for measure in ("vocab_kl_train_infer", "vocab_kl_infer_train", "vocab_tv"):
                assert row[f"{measure}_mean"] == pytest.approx(hand[measure].mean(), rel=1e-9, abs=1e-15)
                assert row[f"{measure}_max"] == pytest.approx(hand[measure].max(), rel=1e-9, abs=1e-15)
            assert row["vocab_top1_agreement"] == hand["vocab_top1_agree"].mean()
            assert row["vocab_top5_overlap"] == pytest.approx(hand["vocab_topk_overlap"].mean(), rel=1e-12)
            assert row["vocab_nonfinite_positions"] == 0 and row["vocab_infinite_kl"] == 0
            if name == "strict":
                assert np.array_equal(a.view(np.int32), b.view(np.int32))
                for measure in ("vocab_kl_train_infer", "vocab_kl_infer_train", "vocab_tv"):
                    assert row[f"{measure}_mean"] == 0.0 and row[f"{measure}_max"] == 0.0
                assert row["vocab_top1_agreement"] == 1.0 and row["vocab_top5_overlap"] == 1.0
            else:
                assert (hand["vocab_kl_train_infer"] > 0).all() and (hand["vocab_kl_infer_train"] > 0).all()
                assert 0 < row["vocab_kl_train_infer_mean"] < 1e-2 and row["vocab_top1_agreement"] < 1
    assert not (runs / "again" / "vocab").exists()  # --full-vocab alone: the rows were deleted after each step
    assert "Full vocabulary (--full-vocab, exact over every entry)" in (runs / "default" / "report.html").read_text()


def test_lr_zero_repeats_every_step_exactly(runs):
    s = steps(runs, "control").drop(columns=TIMINGS + ["step", "epoch"], errors="ignore")  # an epoch a step
    first = s.iloc[0]
    for i in range(1, len(s)):
        assert s.iloc[i].equals(first), s.iloc[i].compare(first)
    record = json.loads((runs / "control" / "run.json").read_text())
    assert first["weights_digest"] == record["initial_sync"]["weights_digest"]  # the weights never moved
    assert first["weights_changed"] == 0 and first["max_abs_dw"] == 0.0
    assert record["weight_sync"]["transport"] == "file" and record["initial_sync"]["changed"] == 0
    shape = record["rollout"]
    assert (shape["group_size"], shape["stop_at_eos"], shape["prompt_logprobs"]) == (4, True, False)  # n = G, EOS
    trainer = record["engines"]["train"]  # recorded as it scores every step: with the replay of processed logprobs
    assert (trainer["replay"]["temperature"], trainer["replay"]["top_k"], trainer["replay"]["top_p"]) == (1.0, 0, 1.0)
    assert "; generated tokens: " in trainer["logprob_formula"]
    plain = json.loads((runs / "default" / "run.json").read_text())["engines"]["train"]
    assert plain["replay"] is None and "generated tokens" not in plain["logprob_formula"]
    assert "strict_backward" not in plain  # no strict op: the variable changes nothing there
    tokens = pd.read_parquet(runs / "control" / "tokens" / "step-00001.parquet")
    lengths = tokens.groupby("seq").size()
    assert len(lengths) == 16 and first["tokens"] == len(tokens) == lengths.sum()
    assert first["completion_len_mean"] == lengths.mean() and first["completion_len_min"] == lengths.min()
    ended = lengths[lengths < 16].index
    assert first["completions_ended_early"] == len(ended) > 0  # seeded: EOS ended some completions
    assert (tokens.groupby("seq")["token_id"].last().loc[ended] == 0).all()  # each at EOS (the fixture's id 0)


def test_the_steps_reach_tensorboard_and_wandb(runs):
    """--log-to tensorboard: the event files, read back with TensorBoard's own reader, hold every numeric column of
    steps.parquet at its step (TensorBoard stores float32); --log-to wandb: an offline run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = steps(runs, "default")
    events = EventAccumulator(str(runs / "default" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    numeric = [c for c in s if c not in ("step", "weights_digest", "prompts_digest") and s[c].notna().all()]
    assert tags == {f"alignaudit/{c}" for c in numeric}
    for column in numeric:
        logged = events.Scalars(f"alignaudit/{column}")
        assert [e.step for e in logged] == s["step"].tolist(), column
        assert [e.value for e in logged] == [float(np.float32(v)) for v in s[column].astype(float)], column
    assert not (runs / "strict" / "tensorboard").exists() and not (runs / "default" / "wandb").exists()
    offline = list((runs / "again" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0


def test_the_same_seed_gives_the_same_run(runs):
    a, b = steps(runs, "default").drop(columns=TIMINGS), steps(runs, "again").drop(columns=TIMINGS)
    pd.testing.assert_frame_equal(a, b)
    assert a["weights_digest"].iloc[-1] == b["weights_digest"].iloc[-1]


def test_max_seconds_ends_a_run_early_as_a_finished_run_that_says_so(runs, tmp_path):
    """--max-seconds 15 with 3 steps asked, on a clock that reads 10 s more after every step: the run stops after
    step 2 (20 s), is sealed complete with steps_run 2 and the reason, and every rendering of the verdict names the
    steps not run; the run that asked for no limit records none."""
    record = json.loads((runs / "again" / "run.json").read_text())
    assert record["status"] == "complete" and record["rl"]["steps"] == 3 and record["rl"]["max_seconds"] == 15
    assert record["steps_run"] == 2 and record["stopped"] == {"by": "max_seconds", "after_step": 2, "elapsed_s": 20.0}
    assert steps(runs, "again")["step"].tolist() == [1, 2]
    assert "stopped after step 2 of 3: --max-seconds 15 had passed" in (runs / "again.stdout").read_text()
    default = json.loads((runs / "default" / "run.json").read_text())
    assert default["stopped"] is None and default["steps_run"] == 2 and default["rl"]["max_seconds"] == 0
    run = tmp_path / "again"
    __import__("shutil").copytree(runs / "again", run)
    assert cli.main(["gate", str(run), "--json", str(tmp_path / "v.json")]) == EXIT_MISMATCH  # the default stack
    note = "steps 3..3 (--max-seconds stopped the run after step 2)"
    assert note in json.loads((tmp_path / "v.json").read_text())["notes"]
    from alignaudit.reports.html import write_report

    assert "Stopped after step 2 of 3 asked: --max-seconds 15 had passed (20 s)." in write_report(run).read_text()


def _resealed(run, edit):
    """Apply ``edit`` to run.json and recompute its seal, as someone who knows the format could."""
    from alignaudit.comparison.integrity import RECORD_SHA256, record_digest

    record = json.loads((run / "run.json").read_text())
    edit(record)
    (run / "run.json").write_text(json.dumps({**record, RECORD_SHA256: record_digest(record)}))


def _step_file(run, step):
    return run / "tokens" / f"step-{step:05d}.parquet"


def _alter_rows(run):
    table = pd.read_parquet(_step_file(run, 2))
    table.loc[0, "lp_infer"] = table.loc[0, "lp_infer"] + 1.0
    table.to_parquet(_step_file(run, 2), index=False)


def _outputs_fixed(run):
    """Recompute the listed sha256 of every output file too (a thorough forger)."""
    from alignaudit.comparison.integrity import file_sha256

    def edit(record):
        record["outputs"] = {name: file_sha256(run / name) for name in record["outputs"] if (run / name).is_file()}

    _resealed(run, edit)


def _edit_steps(run, **changes):
    """Set columns of steps.parquet (step -> value) and fix every checksum after it."""
    table = pd.read_parquet(run / "steps.parquet")
    for column, (step, value) in changes.items():
        table.loc[table["step"] == step, column] = value
    table.to_parquet(run / "steps.parquet", index=False)
    _outputs_fixed(run)


@pytest.mark.parametrize(
    "damage, code, message",
    [
        (lambda r: _alter_rows(r), EXIT_USAGE, "is missing or is not the file this run wrote"),
        (
            lambda r: _step_file(r, 2).write_bytes(_step_file(r, 1).read_bytes()),
            EXIT_USAGE,
            "is missing or is not the file this run wrote",
        ),
        (lambda r: _step_file(r, 3).unlink(), EXIT_USAGE, "tokens/step-00003.parquet is missing"),
        (
            lambda r: __import__("shutil").rmtree(r / "tokens"),
            EXIT_USAGE,
            "is missing or is not the file this run wrote",
        ),
        (
            lambda r: (_alter_rows(r), _outputs_fixed(r)),
            EXIT_USAGE,
            "step 2: mismatches 0 in steps.parquet, 1 from the step's token rows",
        ),
        (
            lambda r: (_step_file(r, 2).write_bytes(_step_file(r, 1).read_bytes()), _outputs_fixed(r)),
            EXIT_USAGE,
            "holds rows of another step",
        ),
        (
            lambda r: _resealed(r, lambda rec: rec["train"].update(strict="")),
            EXIT_USAGE,
            "train engine's strict '' in run.json",
        ),
        (
            lambda r: _resealed(r, lambda rec: rec["infer"].update(engine="hf")),
            EXIT_USAGE,
            "rollout engine's engine 'hf' in run.json",
        ),
        (
            lambda r: (r / "run.json").write_text(
                (r / "run.json").read_text().replace('"strict": "all"', '"strict": ""')
            ),
            EXIT_USAGE,
            "was changed after the run finished",
        ),
        (
            lambda r: _resealed(r, lambda rec: rec.update(initial_sync={**rec["initial_sync"], "bit_equal": False})),
            EXIT_MISMATCH,
            "the initial weight sync (before step 1) was not bit-equal",
        ),
        (
            lambda r: _edit_steps(r, train_forward_equal=(2, False)),
            EXIT_MISMATCH,
            "the training forward's logprobs differed from the rescoring's at 1 of 3 steps (first: step 2)",
        ),
        (
            lambda r: _edit_steps(r, sync_stale_packed=(3, 1)),
            EXIT_MISMATCH,
            "packed GEMMs computed with stale weights after the sync at 1 of 3 steps (first: step 3)",
        ),
        (
            lambda r: _edit_steps(r, vocab_kl_train_infer_mean=(2, 1e-3)),
            EXIT_USAGE,
            "step 2: vocab_kl_train_infer_mean 0.001 in steps.parquet, 0.0 from the step's token rows",
        ),
        (
            lambda r: _resealed(
                r, lambda rec: rec.update(stopped={"by": "max_seconds", "after_step": 2, "elapsed_s": 1.0}, steps_run=2)
            ),
            EXIT_USAGE,
            "does not hold steps 1..2 in order",
        ),
        (lambda r: _resealed(r, lambda rec: rec.update(steps_run=2)), EXIT_USAGE, "steps asked 3, run 2, stopped None"),
        (
            lambda r: _edit_steps(r, sync_replicas_diverged=(1, 2)),
            EXIT_MISMATCH,
            "replicated parameters differed between tensor-parallel ranks at 1 of 3 steps (first: step 1)",
        ),
    ],
)
def test_an_altered_rl_run_never_passes(runs, tmp_path, capsys, damage, code, message):
    """Every per-token file, record field and per-step check the rl verdict rests on is judged: gate exits 2
    naming what was altered, or 1 where the (resealed) record itself says a check failed; never 0."""
    import shutil

    run = tmp_path / "strict"
    shutil.copytree(runs / "strict", run)
    damage(run)
    argv = [
        "gate",
        str(run),
        "--json",
        str(tmp_path / "v.json"),
        "--junit",
        str(tmp_path / "j.xml"),
        "--markdown",
        str(tmp_path / "s.md"),
    ]
    if code == EXIT_MISMATCH:
        assert cli.main(argv) == EXIT_MISMATCH
        assert message in json.loads((tmp_path / "v.json").read_text())["reasons"]
        return
    assert message in one_line_error(capsys, argv, EXIT_USAGE)
    assert not (tmp_path / "v.json").exists()


def test_a_step_whose_update_was_not_finite_is_an_engine_error_for_the_gate(runs, tmp_path, capsys):
    """A NaN grad norm means the optimizer wrote NaN weights (--kl-coef 1e308 once did, exit 0 and a passing
    gate): whatever the token counts say after it, gate refuses to judge, exit 3, naming the step."""
    import shutil

    run = tmp_path / "strict"
    shutil.copytree(runs / "strict", run)
    _edit_steps(run, grad_norm=(2, float("nan")))
    message = one_line_error(capsys, ["gate", str(run)], EXIT_ENGINE)
    assert "a non-finite loss or grad norm at 1 steps (first: step 2)" in message


def test_every_steps_column_is_documented(runs):
    """docs/rl.md's steps.parquet table names every column a run writes (the strict run with --kl-coef and
    --full-vocab, the default run with thresholds): a column added to rl/loop.py without its meaning fails here.
    Names are read from the table's first cells: `a`, `b` and the suffix forms `_max` (of the name before it) and
    `is_<name>` (every column of the summary's importance record)."""
    import re
    from pathlib import Path

    from alignaudit.comparison.importance import FIELDS

    text = (Path(__file__).resolve().parents[2] / "docs" / "rl.md").read_text()
    table = text.split("`steps.parquet` columns", 1)[1].split("\n\n", 2)[1]
    documented: set[str] = set()
    for row in table.splitlines()[2:]:
        last = ""
        for name in re.findall(r"`([a-z0-9_<>]+)`", row.split("|")[1]):
            name = last.rsplit("_", 1)[0] + name if name.startswith("_") else name
            documented.add(name)
            last = name
    documented |= {f"is_{field}" for field in FIELDS}
    for name in ("strict", "default"):
        columns = set(pd.read_parquet(runs / name / "steps.parquet").columns)
        assert columns - documented == set(), name
