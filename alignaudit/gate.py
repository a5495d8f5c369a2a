"""The CI gate: a verdict on a per-token comparison, and its JUnit, JSON and Markdown renderings.

The default rule is the strict one: every compared token's fp32 logprob bitwise equal. Relaxations are
explicit and combine (every given criterion must hold):
    max_mismatch   at most N mismatching tokens (an integer), or at most a fraction of them ("0.5%", 0.005)
    max_ulp        no token further apart than N ULP
    max_abs        no token with |lp_train - lp_infer| above X
    baseline       no regression against a stored verdict: mismatches, max ULP and max |d| may not grow
The gate never passes on nothing: zero compared tokens is an input error, and a NaN logprob on either
side is an engine failure (verdict "error", exit code 3), whatever the rule. What it judges is checked
first (alignaudit.verify.load_run: the same validation ``diff`` uses, plus the run's own record).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from alignaudit.errors import EXIT_ENGINE, InputError
from alignaudit.numerics import hex_bits


@dataclass(frozen=True)
class Rule:
    max_mismatch: int | None = None
    max_mismatch_fraction: float | None = None
    max_ulp: int | None = None
    max_abs: float | None = None
    baseline: dict | None = None

    @property
    def is_default(self) -> bool:
        return all(v is None for v in (self.max_mismatch, self.max_mismatch_fraction, self.max_ulp, self.max_abs,
                                       self.baseline))

    def describe(self) -> str:
        if self.is_default:
            return "every token bitwise equal"
        parts = []
        if self.max_mismatch is not None:
            parts.append(f"at most {self.max_mismatch} mismatching tokens")
        if self.max_mismatch_fraction is not None:
            parts.append(f"at most {self.max_mismatch_fraction:.4%} mismatching tokens")
        if self.max_ulp is not None:
            parts.append(f"max ULP <= {self.max_ulp}")
        if self.max_abs is not None:
            parts.append(f"max |d logprob| <= {self.max_abs:g}")
        if self.baseline is not None:
            parts.append("no regression against the baseline")
        return "; ".join(parts)


def parse_max_mismatch(value: str | None) -> tuple[int | None, float | None]:
    """``"3"`` -> (3, None); ``"0.5%"`` -> (None, 0.005); ``"0.005"`` -> (None, 0.005).

    Raises InputError for anything else (negative, or a fraction above 1).
    """
    if value is None:
        return None, None
    text = value.strip()
    try:
        if text.endswith("%"):
            fraction = float(text[:-1]) / 100
        elif text.isdigit():
            return int(text), None
        else:
            fraction = float(text)
    except ValueError:
        raise InputError(f"--max-mismatch {value!r}: give a token count (3) or a fraction (0.5% or 0.005)") from None
    if not 0 <= fraction <= 1:
        raise InputError(f"--max-mismatch {value!r}: a fraction must lie in [0, 1]")
    return None, fraction


def read_baseline(path: Path) -> dict:
    """A stored verdict.json (or summary.json) with mismatches, ulp_max and max_abs_diff."""
    try:
        data = json.loads(Path(path).read_text())
        return {k: data[k] for k in ("mismatches", "ulp_max", "max_abs_diff")}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise InputError(f"--baseline {path}: not a readable alignaudit verdict.json or summary.json ({e})") from e


@dataclass
class Verdict:
    passed: bool
    rule: str
    tokens_compared: int
    mismatches: int
    ulp_max: int | None
    max_abs_diff: float | None
    reasons: list[str] = field(default_factory=list)
    sequences: list[dict] = field(default_factory=list)
    run: str = ""
    error: str | None = None  # an engine failure the gate cannot judge (NaN logprobs)
    nan_tokens: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_ENGINE if self.error else 0 if self.passed else 1

    @property
    def label(self) -> str:
        return "error" if self.error else "pass" if self.passed else "fail"

    def to_dict(self) -> dict:
        return {"verdict": self.label, **asdict(self)}


def judge_run(run_dir: Path, rule: Rule) -> Verdict:
    """Validate a finished run end to end (alignaudit.verify.load_run), then judge its tokens.

    Raises:
        InputError: the run directory fails validation, or holds no tokens.
    """
    from alignaudit.diff import align_tokens, compare_tokens
    from alignaudit.verify import load_run

    run = load_run(run_dir)
    return evaluate(compare_tokens(align_tokens(run.train.logprobs, run.infer.logprobs)), rule, str(run_dir))


def evaluate(tokens: pd.DataFrame, rule: Rule, run: str = "") -> Verdict:
    """Judge a ``diff.compare_tokens`` table.

    A NaN logprob on either side makes the verdict an engine error (``error`` set, exit code 3).

    Raises:
        InputError: no tokens compared.
    """
    n = len(tokens)
    if n == 0:
        raise InputError("the comparison holds no tokens; the gate never passes on nothing")
    errors, nan_tokens = [], {}
    for side in ("lp_train", "lp_infer"):
        nan = np.isnan(tokens[side].to_numpy(dtype=np.float64))
        nan_tokens[side[3:]] = int(nan.sum())
        if nan.any():
            row = tokens[nan].iloc[0]
            errors.append(f"{side[3:]} engine produced NaN logprobs ({int(nan.sum())} of {n} tokens, first at seq "
                          f"{row['seq']} pos {row['pos']})")
    equal = tokens["bitwise_equal"].to_numpy(dtype=bool)
    mismatches = int((~equal).sum())
    finite = tokens["ulp"].to_numpy() >= 0
    ulp_max = int(tokens["ulp"].to_numpy()[finite].max()) if finite.any() else None
    abs_d = np.abs(tokens["diff"].to_numpy(dtype=np.float64))
    max_abs = float(abs_d[np.isfinite(abs_d)].max()) if np.isfinite(abs_d).any() else None
    reasons = []
    nonfinite = int((~finite).sum())
    if nonfinite:
        reasons.append(f"{nonfinite} tokens differ by an infinity (no ULP distance)")
    if rule.is_default and mismatches:
        reasons.append(f"{mismatches} of {n} tokens are not bitwise equal")
    if rule.max_mismatch is not None and mismatches > rule.max_mismatch:
        reasons.append(f"{mismatches} mismatching tokens > {rule.max_mismatch} allowed")
    if rule.max_mismatch_fraction is not None and mismatches > rule.max_mismatch_fraction * n:
        reasons.append(f"{mismatches / n:.4%} mismatching tokens > {rule.max_mismatch_fraction:.4%} allowed")
    if rule.max_ulp is not None and (ulp_max or 0) > rule.max_ulp:
        reasons.append(f"max ULP {ulp_max} > {rule.max_ulp}")
    if rule.max_abs is not None and (max_abs or 0.0) > rule.max_abs:
        reasons.append(f"max |d logprob| {max_abs:.3e} > {rule.max_abs:g}")
    if rule.baseline is not None:
        b = rule.baseline
        for key, now in (("mismatches", mismatches), ("ulp_max", ulp_max or 0), ("max_abs_diff", max_abs or 0.0)):
            if now > (b.get(key) or 0):
                reasons.append(f"{key} regressed: {now} > baseline {b.get(key)}")
    error = "; ".join(errors) + "; the gate cannot judge NaN" if errors else None
    return Verdict(not reasons and not error, rule.describe(), n, mismatches, ulp_max, max_abs, reasons,
                   _sequences(tokens), run, error, nan_tokens)


def _sequences(tokens: pd.DataFrame) -> list[dict]:
    rows = []
    for seq, g in tokens.groupby("seq", sort=True):
        bad = g[~g["bitwise_equal"]]
        nan = int((np.isnan(g["lp_train"].to_numpy()) | np.isnan(g["lp_infer"].to_numpy())).sum())
        row = {"seq": int(seq), "tokens": len(g), "mismatches": len(bad), "nan_tokens": nan}
        if len(bad):
            first = bad.sort_values("pos").iloc[0]
            lp = torch.tensor([first["lp_train"], first["lp_infer"]], dtype=torch.float32)
            row["first_mismatch"] = {
                "pos": int(first["pos"]), "token_id": int(first["token_id"]), "ulp": int(first["ulp"]),
                "train": float(first["lp_train"]), "infer": float(first["lp_infer"]),
                "train_hex": hex_bits(lp[0]), "infer_hex": hex_bits(lp[1]),
            }
        rows.append(row)
    return rows


def _first_message(row: dict) -> str:
    f = row["first_mismatch"]
    return (f"{row['mismatches']} of {row['tokens']} tokens differ; first at position {f['pos']} (token {f['token_id']}): "
            f"train {f['train']:.9g} ({f['train_hex']}) vs infer {f['infer']:.9g} ({f['infer_hex']}), {f['ulp']} ULP")


def junit_xml(verdict: Verdict, name: str = "alignaudit.gate") -> str:
    """JUnit XML: one test case per sequence. A sequence with NaN logprobs is an <error>; one with
    mismatches a <failure> when the verdict fails (under a relaxed rule that passes, its mismatches are
    reported as system-out)."""
    suite = ET.Element("testsuite", name=name)
    failures = errors = 0
    for row in verdict.sequences:
        case = ET.SubElement(suite, "testcase", classname=name, name=f"sequence {row['seq']}")
        if row.get("nan_tokens"):
            errors += 1
            ET.SubElement(case, "error", message=f"{row['nan_tokens']} NaN logprobs", type="NaNLogprob").text = verdict.error
        elif row["mismatches"]:
            message = _first_message(row)
            if verdict.passed:
                ET.SubElement(case, "system-out").text = message
            else:
                failures += 1
                ET.SubElement(case, "failure", message=message, type="LogprobMismatch").text = (
                    f"rule: {verdict.rule}\n" + "\n".join(verdict.reasons))
    tests = len(verdict.sequences)
    if not verdict.passed and failures + errors == 0:  # failed on a rule that is not per sequence (e.g. baseline)
        case = ET.SubElement(suite, "testcase", classname=name, name="rule")
        ET.SubElement(case, "failure", message="; ".join(verdict.reasons), type="RuleViolation")
        tests, failures = tests + 1, 1
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


def write_outputs(verdict: Verdict, json_path: Path, junit_path: Path, md_path: Path, append_md: bool) -> None:
    """verdict.json, junit.xml and the Markdown summary (appended to an existing ``md_path`` with
    ``append_md``, as GitHub's $GITHUB_STEP_SUMMARY expects).

    Raises:
        InputError: a path cannot be written.
    """
    try:
        Path(json_path).write_text(json.dumps(verdict.to_dict(), indent=2) + "\n")
        Path(junit_path).write_text(junit_xml(verdict))
        with open(md_path, "a" if append_md and Path(md_path).exists() else "w") as f:
            f.write(markdown(verdict))
    except OSError as e:
        raise InputError(f"cannot write the verdict to {e.filename}: {e.strerror}; pass --json, --junit and "
                         "--markdown to write it elsewhere") from e


def markdown(verdict: Verdict, title: str = "alignaudit gate") -> str:
    """A Markdown summary for a CI job page (GitHub's $GITHUB_STEP_SUMMARY, GitLab's artifacts)."""
    icon = verdict.label.upper()
    lines = [f"### {title}: {icon}", "", f"Rule: {verdict.rule}.", "",
             "| tokens compared | mismatching | max ULP | max \\|d logprob\\| |", "|---|---|---|---|",
             f"| {verdict.tokens_compared} | {verdict.mismatches} | {verdict.ulp_max} | "
             f"{'-' if verdict.max_abs_diff is None else format(verdict.max_abs_diff, '.3e')} |", ""]
    if verdict.error:
        lines += [f"- engine error: {verdict.error}", ""]
    if verdict.reasons:
        lines += [f"- {r}" for r in verdict.reasons] + [""]
    failing = [r for r in verdict.sequences if r["mismatches"]]
    if failing:
        lines += ["| sequence | first mismatch |", "|---|---|"]
        lines += [f"| {r['seq']} | {_first_message(r)} |" for r in failing[:20]]
        if len(failing) > 20:
            lines.append(f"| ... | {len(failing) - 20} more sequences |")
        lines.append("")
    return "\n".join(lines) + "\n"
