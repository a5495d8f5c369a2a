"""`alignaudit rescore`: rollouts a framework recorded, scored by the training engine.

The chain: compare --mode rollout has vLLM sample and Megatron score; the same rollouts written to a file
(token ids, prompt lengths, vLLM's logprobs of the sampled tokens) and rescored with Megatron must give
compare's numbers for the sampled tokens, bit for bit, from JSONL and from parquet; gate judges the run; a
damaged file is refused with one line before any engine starts.
"""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, InputError
from helpers import one_line_error

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def rollout_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rescore") / "compare"
    assert cli.main(["compare", "--mode", "rollout", "--max-new-tokens", "8", "--out", str(out)]) == EXIT_OK
    return out


def rollout_rows(run) -> list[dict]:
    """The compare run's rollouts as a framework would dump them: ids, prompt length, the sampled logprobs."""
    table = pd.read_parquet(run / "infer" / "logprobs.parquet")
    lengths = json.loads((run / "infer" / "manifest.json").read_text())["rollout"]["prompt_lengths"]
    rows = []
    for (_seq, group), n in zip(table.groupby("seq"), lengths, strict=True):
        group = group.sort_values("pos")
        rows.append(
            {
                "token_ids": group["token_id"].tolist(),
                "prompt_length": n,
                "logprobs": group["logprob"][group["generated"]].astype(float).tolist(),
            }
        )
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_nemo_rl(path, rows):
    """The rollouts as NeMo-RL's GRPO writes train_data_step{N}.jsonl (nemo_rl/algorithms/grpo.py; Logger.
    log_batched_dict_as_jsonl: one line per sample, each value a batch of one, token rows right-padded to the
    step's longest, logprobs at the position of their token, 0 elsewhere)."""
    width = max(len(r["token_ids"]) for r in rows)
    lines = []
    for i, r in enumerate(rows):
        n, p = len(r["token_ids"]), r["prompt_length"]
        pad = [0] * (width - n)
        lines.append(
            {
                "content": [f"prompt {i}", f"response {i}"],
                "rewards": [0.5],
                "input_lengths": [n],
                "token_ids": [r["token_ids"] + pad],
                "token_loss_mask": [[0] * p + [1] * (n - p) + pad],
                "sample_loss_mask": [1.0],
                "advantages": [[0.0] * width],
                "generation_logprobs": [[0.0] * p + r["logprobs"] + [0.0] * len(pad)],
                "prev_logprobs": [[0.0] * width],
                "idx": i,
            }
        )
    path.parent.mkdir(parents=True)
    return write_jsonl(path, lines)


def write_slime(path, rows):
    """The rollouts as slime's --save-debug-rollout-data writes them (slime/observability/rollout_data_utils.py:
    torch.save of {"rollout_id", "samples": [Sample.to_dict()]}; slime/utils/types.py Sample)."""
    import torch

    samples = [
        {
            "group_index": i // 2,
            "index": i,
            "rollout_id": None,
            "prompt": f"prompt {i}",
            "tokens": r["token_ids"],
            "multimodal_inputs": None,
            "response": f"response {i}",
            "response_length": len(r["logprobs"]),
            "label": None,
            "reward": 0.5,
            "loss_mask": [1] * len(r["logprobs"]),
            "weight_versions": ["1"],
            "rollout_log_probs": r["logprobs"],
            "rollout_routed_experts": None,
            "remove_sample": False,
            "status": "completed",
            "metadata": {},
            "spec_info": {},
            "prefix_cache_info": {},
        }
        for i, r in enumerate(rows)
    ]
    path.parent.mkdir(parents=True)
    torch.save({"rollout_id": 0, "samples": samples}, path)
    return path


def test_rescore_gives_compare_numbers_for_the_sampled_tokens_and_gate_judges_it(rollout_run, tmp_path):
    compared = json.loads((rollout_run / "summary.json").read_text())["generated"]
    rows = rollout_rows(rollout_run)
    assert len(rows) == 4 and all(len(r["logprobs"]) == 8 for r in rows)
    files = {
        "jsonl": write_jsonl(tmp_path / "rollouts.jsonl", rows),
        "parquet": tmp_path / "rollouts.parquet",
        "nemo-rl": write_nemo_rl(tmp_path / "logs" / "exp_001" / "train_data_step1.jsonl", rows),
        "slime": write_slime(tmp_path / "rollout_data" / "0.pt", rows),
    }
    pd.DataFrame(rows).to_parquet(files["parquet"])
    expected = pd.read_parquet(rollout_run / "tokens.parquet")
    expected = expected[expected["generated"]].reset_index(drop=True)
    for kind, path in files.items():
        out = tmp_path / f"rescore-{kind}"
        assert cli.main(["rescore", str(path), "--train", "megatron", "--out", str(out)]) == EXIT_OK
        summary = json.loads((out / "summary.json").read_text())
        for key in ("tokens_compared", "mismatches", "ulp_max", "max_abs_diff", "ulp_histogram", "rl", "importance"):
            assert summary[key] == compared[key], (kind, key)
        assert summary["tokens_compared"] == 32 and summary["mismatches"] > 0  # the default stack differs
        tokens = pd.read_parquet(out / "tokens.parquet")
        for column in ("seq", "pos", "token_id"):
            assert tokens[column].tolist() == expected[column].tolist()
        for column in ("lp_train", "lp_infer"):
            assert (tokens[column].to_numpy().view("int32") == expected[column].to_numpy().view("int32")).all()
        record = json.loads((out / "run.json").read_text())
        assert record["command"] == "rescore" and record["source"]["format"] == kind
        assert record["infer"]["engine"] == "rollout-file" and record["infer"]["dtype"] is None
        assert record["rollout"]["logprobs_mode"] == "raw"
        assert record["rollout_assumed"] == ([] if "logprobs_mode" in rows[0] else ["logprobs_mode"]), kind
        assert cli.main(["gate", str(out), "--json", str(tmp_path / f"verdict-{kind}.json")]) == EXIT_MISMATCH
        verdict = json.loads((tmp_path / f"verdict-{kind}.json").read_text())
        assert verdict["tokens_compared"] == 32 and verdict["mismatches"] == summary["mismatches"]
    assert cli.main(["report", str(out), "--html", str(tmp_path / "page.html")]) == EXIT_OK  # checked, then shown
    page = (tmp_path / "page.html").read_text()
    assert "megatron (bf16, cpu) vs rollout-file" in page and "32 of 32 tokens differ" in page


def test_errors_name_where_the_rollout_sits_in_its_file(rollout_run, tmp_path):
    """A JSON lines file is named by its 1-based line (a blank line counted, as an editor counts), a parquet table
    by its 0-based row (as pandas indexes it)."""
    from alignaudit.inputs.rollouts import read_rollouts

    rows = rollout_rows(rollout_run)
    rows[1]["logprobs"][0] = 0.5
    text = tmp_path / "gap.jsonl"
    text.write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))
    with pytest.raises(InputError, match=r"gap.jsonl: line 3: logprob 0 is 0.5, above 0"):
        read_rollouts(text, 512)
    pd.DataFrame(rows).to_parquet(tmp_path / "table.parquet")
    with pytest.raises(InputError, match=r"table.parquet: row 1: logprob 0 is 0.5, above 0"):
        read_rollouts(tmp_path / "table.parquet", 512)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("logprobs"), "line 1 has no logprobs"),
        (lambda r: r["logprobs"].pop(), "line 1 has 7 logprobs for 8 sampled tokens"),
        (lambda r: r["logprobs"].__setitem__(2, float("nan")), "line 1: logprob 2 is nan"),
        (lambda r: r.__setitem__("prompt_length", len(r["token_ids"])), "prompt_length"),
        (lambda r: r["token_ids"].__setitem__(0, 10**6), "outside the model's vocabulary"),
        (lambda r: r.update(logprobs_mode="processed"), "logprobs_mode differs between rollouts"),
        (lambda r: r["logprobs"].__setitem__(1, -1e39), "line 1: logprob 1 is -1e+39, outside fp32's range"),
        (lambda r: r["logprobs"].__setitem__(3, 0.25), "line 1: logprob 3 is 0.25, above 0"),
    ],
)
def test_a_damaged_rollout_file_is_refused_before_any_engine(rollout_run, tmp_path, capsys, edit, message):
    rows = rollout_rows(rollout_run)
    edit(rows[0])
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "never"
    assert message in one_line_error(capsys, ["rescore", str(path), "--out", str(out)], EXIT_USAGE)
    assert not out.exists()


def test_dumps_without_token_ids_or_logprobs_are_refused_with_the_reason(tmp_path, capsys):
    verl = write_jsonl(tmp_path / "1.jsonl", [{"input": "2+2=", "output": "4", "score": 1.0, "step": 1}])
    assert "looks like a verl rollout_data_dir dump" in one_line_error(
        capsys, ["rescore", str(verl), "--out", str(tmp_path / "o")], EXIT_USAGE
    )
    processed = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "token_ids": [1, 2, 3],
                "prompt_length": 2,
                "logprobs": [-1.0],
                "logprobs_mode": "processed",
                "temperature": 0.7,
            }
        ],
    )
    assert "the logprobs are processed but the file gives no top_k, top_p" in one_line_error(
        capsys, ["rescore", str(processed), "--out", str(tmp_path / "o")], EXIT_USAGE
    )
    assert "rescore scores with a training engine" in one_line_error(
        capsys, ["rescore", str(processed), "--train", "vllm", "--out", str(tmp_path / "o")], EXIT_USAGE
    )


SETTINGS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


@pytest.mark.parametrize(
    "mode, settings, message",
    [
        ("raw", {"temperature": "hot"}, "temperature 'hot': a number >= 0"),
        ("raw", {"temperature": -1}, "temperature -1: a number >= 0"),
        ("processed", {"temperature": 0}, "temperature 0: a number > 0 (processed logprobs at temperature 0"),
        ("processed", {"temperature": "0.7"}, "temperature '0.7': a number > 0"),
        ("processed", {"top_p": 0}, "top_p 0: a number in (0, 1]"),
        ("processed", {"top_p": 2}, "top_p 2: a number in (0, 1]"),
        ("processed", {"top_k": -2}, "top_k -2: an integer"),
        ("processed", {"top_k": 1.5}, "top_k 1.5: an integer"),
    ],
)
def test_sampling_settings_that_are_no_valid_value_are_refused(tmp_path, capsys, mode, settings, message):
    """Checked before the trainer starts (it crashed on them, leaving the run marked running), and never recorded
    as the setting the rollouts were sampled with."""
    row = {
        "token_ids": [1, 2, 3, 4],
        "prompt_length": 2,
        "logprobs": [-1.0, -2.0],
        "logprobs_mode": mode,
        **SETTINGS,
        **settings,
    }
    path = write_jsonl(tmp_path / "r.jsonl", [row])
    out = tmp_path / "never"
    assert message in one_line_error(capsys, ["rescore", str(path), "--out", str(out)], EXIT_USAGE)
    assert not out.exists()


def test_a_negated_file_is_named_as_negative_log_likelihoods(rollout_run, tmp_path, capsys):
    rows = rollout_rows(rollout_run)
    for row in rows:
        row["logprobs"] = [-v for v in row["logprobs"]]
    path = write_jsonl(tmp_path / "nll.jsonl", rows)
    assert "these are negative log-likelihoods (-logprob), not logprobs; negate them" in one_line_error(
        capsys, ["rescore", str(path), "--out", str(tmp_path / "never")], EXIT_USAGE
    )


def test_files_of_other_formats_get_one_line_naming_what_rescore_reads(rollout_run, tmp_path, capsys):
    """verl's RolloutSkip dump (a pickle), gzip'd, UTF-16 or Latin-1 JSON lines, a torch.save file that is not
    slime's: exit 2, the formats named; a parquet file named .jsonl is read as the parquet it is (the content
    decides, not the name)."""
    import gzip
    import pickle

    import torch

    from alignaudit.inputs.rollouts import read_rollouts

    rows = rollout_rows(rollout_run)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    files = {
        "gz.jsonl": (gzip.compress(text.encode()), "is gzip-compressed"),
        "utf16.jsonl": (text.encode("utf-16"), "is UTF-16 text"),
        "latin1.jsonl": (text.replace("token_ids", "t\xf6ken_ids").encode("latin-1"), "is not UTF-8 text"),
        "pickled.pkl": (pickle.dumps({"samples": rows}), "is a pickle"),
    }
    for name, (content, what) in files.items():
        (tmp_path / name).write_bytes(content)
        err = one_line_error(capsys, ["rescore", str(tmp_path / name), "--out", str(tmp_path / "never")], EXIT_USAGE)
        assert what in err and "rescore reads JSON lines (UTF-8 text" in err, (name, err)
    torch.save({"model": torch.zeros(2)}, tmp_path / "weights.pt")  # a torch.save file that is no slime dump
    err = one_line_error(
        capsys, ["rescore", str(tmp_path / "weights.pt"), "--out", str(tmp_path / "never")], EXIT_USAGE
    )
    assert "holds no slime samples" in err
    assert not (tmp_path / "never").exists()
    pd.DataFrame(rows).to_parquet(tmp_path / "named.jsonl")
    read = read_rollouts(tmp_path / "named.jsonl", 512)
    assert read.source["format"] == "parquet" and len(read.logprobs) == len(rows)
    latin = tmp_path / "baseline.json"
    latin.write_bytes('{"mismatches": 0, "n\xf6": 1}'.encode("latin-1"))
    assert "not UTF-8 text" in one_line_error(capsys, ["gate", str(rollout_run), "--baseline", str(latin)], EXIT_USAGE)


def test_sampling_options_for_raw_logprobs_are_refused_and_an_unstated_mode_is_recorded_as_assumed(tmp_path, capsys):
    """--temperature / --top-k / --top-p change only what processed logprobs are scored under: with raw ones they
    are refused, not recorded as applied; a file and command line that do not say the mode get raw (vLLM's default),
    named as assumed."""
    from alignaudit.inputs.rollouts import read_rollouts

    row = {"token_ids": [1, 2, 3], "prompt_length": 2, "logprobs": [-0.5]}
    path = write_jsonl(tmp_path / "r.jsonl", [row])
    for extra in (["--temperature", "0.7"], ["--logprobs-mode", "raw", "--top-k", "5", "--top-p", "0.9"]):
        err = one_line_error(capsys, ["rescore", str(path), *extra, "--out", str(tmp_path / "never")], EXIT_USAGE)
        assert "given for raw logprobs: only processed logprobs are scored under the sampling transform" in err
    assert not (tmp_path / "never").exists()
    unstated = read_rollouts(path, 512)
    assert unstated.sampling == {"logprobs_mode": "raw"} and unstated.assumed == ("logprobs_mode",)
    stated = read_rollouts(path, 512, {"logprobs_mode": "raw"})
    assert stated.sampling == {"logprobs_mode": "raw"} and stated.assumed == ()
    (tmp_path / "dir.jsonl").mkdir()
    text = tmp_path / "notes.pt"
    text.write_text("hello\n")
    nemo = write_nemo_rl(tmp_path / "nemo" / "train_data_step1.jsonl", [{**row, "logprobs": [-0.5]}])
    line = json.loads(nemo.read_text())
    del line["generation_logprobs"]  # NeMo-RL writes it only where the rollout engine returned logprobs
    nemo.write_text(json.dumps(line) + "\n")
    for bad, what in (
        (tmp_path / "dir.jsonl", "dir.jsonl: a directory; give a JSONL or parquet file"),
        (text, "notes.pt:1: not valid JSON (Expecting value); rescore reads JSON lines"),
        (
            nemo,
            "train_data_step1.jsonl:1 looks like NeMo-RL's train_data_step (input_lengths, "
            "token_loss_mask) but has no generation_logprobs; rescore reads NeMo-RL's lines with",
        ),
    ):
        assert what in one_line_error(capsys, ["rescore", str(bad), "--out", str(tmp_path / "never")], EXIT_USAGE)


def test_vllm_disabled_top_k_is_read_as_disabled(tmp_path):
    from alignaudit.inputs.rollouts import read_rollouts

    row = {
        "token_ids": [1, 2, 3],
        "prompt_length": 2,
        "logprobs": [-0.5],
        "logprobs_mode": "processed",
        "temperature": 0.7,
        "top_k": -1,
        "top_p": 1.0,
    }
    assert read_rollouts(write_jsonl(tmp_path / "r.jsonl", [row]), 512).sampling["top_k"] == 0
    long = write_jsonl(tmp_path / "long.jsonl", [row, {**row, "token_ids": [5] * 41, "logprobs": [-1.0] * 40}])
    with pytest.raises(InputError, match=r"long.jsonl: line 2 has 41 token_ids, more than the model's 40 positions"):
        read_rollouts(long, 512, max_positions=40)


def test_framework_dumps_they_cannot_be_rescored_from_are_refused_with_the_reason(tmp_path, capsys):
    """Multi-turn loss masks (tool tokens between generated spans, never sampled by the engine), a slime sample
    without rollout logprobs, and a sampling setting given twice with two values."""
    row = {"token_ids": [1, 2, 3, 4, 5, 6], "prompt_length": 2, "logprobs": [-1.0, -2.0, -0.5, -0.1]}
    nemo = write_nemo_rl(tmp_path / "n" / "train_data_step1.jsonl", [row])
    line = json.loads(nemo.read_text())
    line["token_loss_mask"] = [[0, 0, 1, 0, 1, 1]]
    nemo.write_text(json.dumps(line) + "\n")
    assert "the loss mask has holes (multi-turn" in one_line_error(
        capsys, ["rescore", str(nemo), "--out", str(tmp_path / "never")], EXIT_USAGE
    )
    slime = write_slime(tmp_path / "s" / "0.pt", [row])
    import torch

    data = torch.load(slime, weights_only=True)
    data["samples"][0]["rollout_log_probs"] = None
    torch.save(data, slime)
    assert "sample 0 has no rollout_log_probs" in one_line_error(
        capsys, ["rescore", str(slime), "--out", str(tmp_path / "never")], EXIT_USAGE
    )
    plain = write_jsonl(tmp_path / "r.jsonl", [{**row, "temperature": 0.7}])
    assert "records temperature 0.7, and --temperature 1.0 was given" in one_line_error(
        capsys, ["rescore", str(plain), "--temperature", "1.0", "--out", str(tmp_path / "never")], EXIT_USAGE
    )
    assert not (tmp_path / "never").exists()


def test_framework_readers_check_every_record_and_take_what_the_masks_say(tmp_path):
    """A later NeMo-RL line missing a key is an input error naming it (it was an unexpected KeyError, exit 3); a
    slime sample's leading loss-mask zeros are response tokens the engine did not sample: scored as context, their
    logprobs dropped (they were rescored as sampled); a pipe is named as one (it was "no such file"); a file whose
    every logprob is exactly 0.0 holds placeholders."""
    import torch

    from alignaudit.inputs.rollouts import read_rollouts

    row = {"token_ids": [1, 2, 3, 4, 5, 6], "prompt_length": 2, "logprobs": [-1.0, -2.0, -0.5, -0.1]}
    nemo = write_nemo_rl(tmp_path / "n" / "train_data_step1.jsonl", [row, row])
    lines = [json.loads(line) for line in nemo.read_text().splitlines()]
    del lines[1]["token_loss_mask"]
    nemo.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(InputError, match="train_data_step1.jsonl: line 2 has no token_loss_mask"):
        read_rollouts(nemo, 512)
    slime = write_slime(tmp_path / "s" / "0.pt", [row])
    data = torch.load(slime, weights_only=True)
    data["samples"][0]["loss_mask"] = [0, 0, 1, 1]
    torch.save(data, slime)
    read = read_rollouts(slime, 512)
    assert read.prompt_lengths == [4] and read.logprobs[0].tolist() == [-0.5, -0.10000000149011612]
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)  # what <(...) hands a command: it exists, and is read once
    with pytest.raises(InputError, match="pipe.jsonl is not a regular file .a pipe or a device"):
        read_rollouts(pipe, 512)
    zeros = write_jsonl(tmp_path / "z.jsonl", [{**row, "logprobs": [0.0] * 4}, {**row, "logprobs": [-0.0] * 4}])
    with pytest.raises(InputError, match="every logprob is exactly 0.0: placeholders"):
        read_rollouts(zeros, 512)
