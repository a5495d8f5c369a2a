"""alignaudit gate running the comparison itself and judging it (`gate --train ... --infer ... --out DIR`): the CI
examples of docs/ci.md as written, and a checkpoint whose logprobs are NaN. gate on finished runs is test_gate.py's.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest

from alignaudit.capture.rundir import LOGPROBS
from alignaudit.commands import cli
from alignaudit.errors import EXIT_ENGINE, EXIT_OK, EXIT_USAGE
from helpers import ROOT, one_line_error, reseal

pytestmark = [pytest.mark.engines, pytest.mark.long]


def ci_examples() -> dict[str, list[str]]:
    """The `alignaudit gate` command of each CI example in docs/ci.md (GitHub Actions, GitLab CI), as argv."""
    import re
    import shlex

    text = (ROOT / "docs" / "ci.md").read_text()
    examples = {}
    for name in ("GitHub Actions", "GitLab CI"):
        section = text.split(f"## {name}", 1)[1].split("\n## ", 1)[0]
        command = re.search(r"(alignaudit gate (?:[^\n]*\\\n)*[^\n]*)", section).group(1)
        examples[name] = shlex.split(command.replace("\\\n", " "))[1:]
    return examples


@pytest.mark.parametrize("name", ["GitHub Actions", "GitLab CI"])
def test_the_ci_examples_of_the_docs_pass_in_a_fresh_checkout(tmp_path, monkeypatch, name):
    """docs/ci.md's commands, run as written in an empty working directory (GitHub's writes its JUnit file
    into reports/, which does not exist yet, and appends to $GITHUB_STEP_SUMMARY)."""
    monkeypatch.chdir(tmp_path)
    summary = tmp_path / "step-summary.md"
    argv = [str(summary) if a == "$GITHUB_STEP_SUMMARY" else a for a in ci_examples()[name]]
    assert cli.main(argv) == EXIT_OK, argv
    verdict = json.loads((tmp_path / "runs" / "ci" / "verdict.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["mismatches"] == 0
    # a rollout scores the sampled tokens (vLLM's default: no prompt logprobs): 4 prompts x 32, none ended at EOS
    assert verdict["tokens_compared"] == (128 if "rollout" in argv else 176)
    junit = tmp_path / argv[argv.index("--junit") + 1]
    suite = ET.fromstring(junit.read_text())
    assert suite.get("tests") == "4" and suite.get("failures") == "0"
    if "--markdown" in argv:
        assert "alignaudit gate: PASS" in summary.read_text()
    if "rollout" in argv:  # how the inference engine sampled is checked against its capture, seal or not
        run = tmp_path / "runs" / "ci"
        record = json.loads((run / "run.json").read_text())
        record["rollout"]["temperature"] = 0.7
        reseal(run, record)
        assert cli.main(["gate", str(run), "--json", str(tmp_path / "again.json")]) == EXIT_USAGE
        assert not (tmp_path / "again.json").exists()


def test_nan_logprobs_are_counted_and_fail_the_gate_as_an_engine_error(tmp_path, capsys):
    """Embedding row 100 set to NaN: the first prompt (which holds token 100) has NaN logprobs on both sides.
    They are kept as values (not dropped like position 0, which has no logprob), counted, and the gate
    exits 3 with the reason; the second prompt is still judged."""
    from safetensors.torch import load_file, save_file

    from helpers import FIXTURE

    model = tmp_path / "nan-model"
    shutil.copytree(FIXTURE, model)
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"][100] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids":[1,2,3,4,5,6,100,7,8,9,10,11]}\n{"token_ids":[20,21,22,23,24,25]}\n')
    out = tmp_path / "run"
    err = one_line_error(
        capsys,
        ["gate", "--train", "hf", "--infer", "hf", "--model", str(model), "--prompts", str(prompts), "--out", str(out)],
        EXIT_ENGINE,
    )
    assert "train engine produced NaN logprobs" in err and "the gate cannot judge NaN" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_compared"] == 16 and summary["sequences"] == 2
    assert summary["nan_tokens"] == {
        "train": summary["nan_tokens"]["both"],
        "infer": summary["nan_tokens"]["both"],
        "both": summary["nan_tokens"]["both"],
    }
    nan = summary["nan_tokens"]["both"]
    assert 6 <= nan <= 11  # positions 6.. see token 100; eager attention spreads NaN to all rows of the sequence
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["verdict"] == "error" and verdict["nan_tokens"] == {"train": nan, "infer": nan}
    suite = ET.fromstring((out / "junit.xml").read_text())
    assert suite.get("errors") == "1" and suite.find("testcase/error").get("type") == "NaNLogprob"
    table = pd.read_parquet(out / "train" / LOGPROBS)
    first = table[table["seq"] == 0]
    assert not first["scored"].iloc[0] and first["scored"].iloc[1:].all()
    assert np.isnan(first["logprob"].iloc[1:]).sum() == nan
    assert not np.isnan(table[table["seq"] == 1]["logprob"].iloc[1:]).any()
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert len(tokens[tokens["seq"] == 0]) == 11
