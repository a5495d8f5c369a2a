"""The CI gate: a verdict on a per-token comparison, and its JUnit, JSON and Markdown renderings.

The default rule is the strict one: every compared token's fp32 logprob bitwise equal. Relaxations are
explicit and combine (every given criterion must hold):
    max_mismatch   at most N mismatching tokens (an integer), or at most a fraction of them ("0.5%", 0.005)
    max_ulp        no token further apart than N ULP
    max_abs        no token with |lp_train - lp_infer| above X
    baseline       no regression against a stored verdict: mismatches, max ULP and max |d| may not grow
The gate never passes on nothing: zero compared tokens is an input error, and a NaN logprob on either
side is an engine failure (verdict "error", exit code 3), whatever the rule. What it judges is checked
first (alignaudit.comparison.integrity.load_run: the same validation ``diff`` uses, plus the run's own record).
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from alignaudit.capture.rundir import JUDGED
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
        return all(
            v is None
            for v in (self.max_mismatch, self.max_mismatch_fraction, self.max_ulp, self.max_abs, self.baseline)
        )

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


def make_rule(
    max_mismatch: str | None = None,
    max_ulp: int | None = None,
    max_abs: float | None = None,
    baseline: Path | None = None,
) -> Rule:
    """The Rule of the gate's options, each validated: a threshold that would pass anything (NaN, a negative
    bound) or a baseline holding one is refused, never judged with.

    Raises:
        InputError: naming the option and what it accepts.
    """
    count, fraction = parse_max_mismatch(max_mismatch)
    if max_ulp is not None and (isinstance(max_ulp, bool) or not isinstance(max_ulp, int) or max_ulp < 0):
        raise InputError(f"--max-ulp {max_ulp!r}: give a whole number of ULP >= 0")
    if max_abs is not None and not (math.isfinite(max_abs) and max_abs >= 0):
        raise InputError(
            f"--max-abs {max_abs!r}: give a finite number >= 0 (NaN or a negative bound would judge nothing)"
        )
    return Rule(count, fraction, max_ulp, max_abs, read_baseline(baseline) if baseline is not None else None)


def read_baseline(path: Path) -> dict:
    """A stored verdict.json (or summary.json): its mismatches (int >= 0), ulp_max (int >= 0 or null) and
    max_abs_diff (finite float >= 0 or null; null counts as 0, the strictest baseline).

    Raises:
        InputError: unreadable, a field missing, or a value no regression could be measured against (NaN,
            negative, not a number).
    """
    from alignaudit.inputs.values import parse_json

    try:
        data = parse_json(Path(path).read_text(), f"--baseline {path}")
        values = {k: data[k] for k in ("mismatches", "ulp_max", "max_abs_diff")}
    except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        reason = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e)
        raise InputError(f"--baseline {path}: not a readable alignaudit verdict.json or summary.json ({reason})") from e
    for key, value in values.items():
        whole = key != "max_abs_diff"
        ok = (value is None and key != "mismatches") or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
            and (not whole or float(value).is_integer())
        )
        if not ok:
            kind = "a whole number >= 0" if whole else "a finite number >= 0"
            raise InputError(
                f"--baseline {path}: {key} is {value!r}, not {kind}; give a verdict.json written by `alignaudit gate`"
            )
    return values


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
    # JUnit test cases: {"name", "status": "pass" | "note" | "fail" | "error", "message"}
    cases: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)  # rl runs: one row per step
    rule_params: dict = field(default_factory=dict)  # the Rule's fields, so a page can judge the run again
    notes: list[str] = field(default_factory=list)  # what the verdict did not judge, said in every rendering

    @property
    def exit_code(self) -> int:
        return EXIT_ENGINE if self.error else 0 if self.passed else 1

    @property
    def label(self) -> str:
        return "error" if self.error else "pass" if self.passed else "fail"

    def to_dict(self) -> dict:
        return {"verdict": self.label, **asdict(self)}


def judge_run(run_dir: Path, rule: Rule) -> Verdict:
    """Validate a finished compare or rl run end to end (alignaudit.comparison.integrity), then judge it.

    Raises:
        InputError: the run directory fails validation, or holds no tokens.
    """
    from alignaudit.comparison.integrity import load_rl_run, load_run, read_run_record
    from alignaudit.comparison.token_diff import align_tokens, compare_tokens

    if read_run_record(run_dir, commands=JUDGED)["command"] == "rl":
        verdict = judge_steps(load_rl_run(run_dir), rule, str(run_dir))
        verdict.rule_params = asdict(rule)
        return verdict
    run = load_run(run_dir)
    verdict = evaluate(compare_tokens(align_tokens(run.train.logprobs, run.infer.logprobs)), rule, str(run_dir))
    verdict.rule_params = asdict(rule)
    return verdict


def rejudge(run_dir: Path, stored: dict) -> dict:
    """A stored verdict.json, judged again from the checked run under the rule it records: the fresh
    verdict's record (Verdict.to_dict), which is what a page shows.

    Raises:
        InputError: the stored verdict records no rule, or any of its verdict, rule, counts, ULP or |d| differs
            from the fresh one (verdict.json edited, or a verdict of another run).
    """
    params = stored.get("rule_params")
    try:
        rule = Rule(**params) if isinstance(params, dict) else None
    except TypeError:  # fields Rule does not have
        rule = None
    if rule is None:
        raise InputError(
            f"{Path(run_dir) / 'verdict.json'} records no rule (written by an older alignaudit?); run "
            "alignaudit gate again"
        )
    fresh = judge_run(Path(run_dir), rule).to_dict()
    for key in ("verdict", "rule", "tokens_compared", "mismatches", "ulp_max", "max_abs_diff", "error"):
        if fresh.get(key) != stored.get(key):
            raise InputError(
                f"{Path(run_dir) / 'verdict.json'} says {key} {stored.get(key)!r}, but judging the run "
                f"again gives {fresh.get(key)!r}; run alignaudit gate again"
            )
    return fresh


def evaluate(tokens: pd.DataFrame, rule: Rule, run: str = "") -> Verdict:
    """Judge a ``diff.compare_tokens`` table.

    A NaN logprob, or one above 0 (+inf included), on either side makes the verdict an engine error (``error``
    set, exit code 3): equal bits of a value that is no log-probability are not alignment.

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
            errors.append(
                f"{side[3:]} engine produced NaN logprobs ({int(nan.sum())} of {n} tokens, first at seq "
                f"{row['seq']} pos {row['pos']})"
            )
        positive = tokens[side].to_numpy(dtype=np.float64) > 0
        if positive.any():
            row = tokens[positive].iloc[0]
            errors.append(
                f"{side[3:]} side holds logprobs above 0, which no log-probability is ({int(positive.sum())} "
                f"of {n} tokens, first {row[side]!r} at seq {row['seq']} pos {row['pos']})"
            )
    mismatches = int((~tokens["bitwise_equal"].to_numpy(dtype=bool)).sum())
    finite = tokens["ulp"].to_numpy() >= 0
    ulp_max = int(tokens["ulp"].to_numpy()[finite].max()) if finite.any() else None
    abs_d = np.abs(tokens["diff"].to_numpy(dtype=np.float64))
    max_abs = float(abs_d[np.isfinite(abs_d)].max()) if np.isfinite(abs_d).any() else None
    nonfinite = int((~finite).sum())
    reasons = [f"{nonfinite} tokens differ by an infinity (no ULP distance)"] if nonfinite else []
    reasons += _rule_reasons(rule, n, mismatches, ulp_max, max_abs)
    error = "; ".join(errors) + ("; the gate cannot judge NaN" if any(nan_tokens.values()) else "") if errors else None
    passed = not reasons and not error
    sequences = _sequences(tokens)
    above = tokens[(tokens["lp_train"] > 0) | (tokens["lp_infer"] > 0)].groupby("seq").size().to_dict()
    cases = [
        _case(
            f"sequence {r['seq']}",
            r["nan_tokens"],
            r["mismatches"] and _first_message(r),
            passed,
            error,
            above.get(r["seq"], 0),
        )
        for r in sequences
    ]
    return Verdict(
        passed, rule.describe(), n, mismatches, ulp_max, max_abs, reasons, sequences, run, error, nan_tokens, cases
    )


STEP_CHECKS = (  # per-step column, what a failing value means
    ("sync_tensors_differing", "weight tensors differed after the sync"),
    ("sync_stale_packed", "packed GEMMs computed with stale weights after the sync"),
    ("sync_replicas_diverged", "replicated parameters differed between tensor-parallel ranks"),
)


def judge_steps(run, rule: Rule, name: str = "") -> Verdict:
    """Judge a checked rl run (integrity.RLRun): the rule over all steps' generated tokens; whatever the rule,
    the initial weight sync and every step's sync bit-equal (no differing tensor, no stale packed GEMM, no
    diverged replica) and the training forward's logprobs equal to the rescoring's; a step with NaN logprobs, or
    with a non-finite loss or grad norm, is an engine error. Without per-token rows (--no-token-rows) the counts
    are steps.parquet's alone, which the verdict says."""
    steps = run.steps
    n, mismatches = int(steps["tokens"].sum()), int(steps["mismatches"].sum())
    ulps, diffs = steps["ulp_max"].dropna(), steps["max_abs_diff"].dropna()
    ulp_max = int(ulps.max()) if len(ulps) else None
    max_abs = float(diffs.max()) if len(diffs) else None
    reasons = _rule_reasons(rule, n, mismatches, ulp_max, max_abs)
    bad = steps[steps["mismatches"] > 0]
    if len(bad) and rule.is_default:
        reasons[0] = f"{len(bad)} of {len(steps)} steps have mismatching tokens ({mismatches} of {n} tokens)"
    if not (run.record.get("initial_sync") or {}).get("bit_equal"):
        reasons.append("the initial weight sync (before step 1) was not bit-equal")
    unsynced = steps[~steps["sync_bit_equal"]]
    if len(unsynced):
        reasons.append(
            f"the weight sync was not bit-equal at {len(unsynced)} of {len(steps)} steps (first: step "
            f"{int(unsynced['step'].iloc[0])})"
        )
    for column, meaning in STEP_CHECKS:
        failing = steps[steps[column] > 0]
        if len(failing):
            reasons.append(
                f"{meaning} at {len(failing)} of {len(steps)} steps (first: step {int(failing['step'].iloc[0])})"
            )
    unequal = steps[~steps["train_forward_equal"]]
    if len(unequal):
        reasons.append(
            f"the training forward's logprobs differed from the rescoring's at {len(unequal)} of "
            f"{len(steps)} steps (first: step {int(unequal['step'].iloc[0])})"
        )
    nan = steps[steps["nan_tokens"] > 0]
    errors = (
        [f"NaN logprobs at {len(nan)} steps (first: step {int(nan['step'].iloc[0])}); the gate cannot judge NaN"]
        if len(nan)
        else []
    )
    positive = steps[steps["positive_tokens"] > 0]
    if len(positive):
        errors.append(
            f"logprobs above 0, which no log-probability is, at {len(positive)} steps (first: step "
            f"{int(positive['step'].iloc[0])})"
        )
    broken = steps[~np.isfinite(steps["loss"].astype(float)) | ~np.isfinite(steps["grad_norm"].astype(float))]
    if len(broken):  # an update from a non-finite loss or gradient: what later steps compare may not be a model
        errors.append(
            f"a non-finite loss or grad norm at {len(broken)} steps (first: step "
            f"{int(broken['step'].iloc[0])}); the updates from them are not trustworthy"
        )
    error = "; ".join(errors) or None
    passed = not reasons and not error
    cases = []
    for row in steps.to_dict("records"):
        problems = (
            [f"{row['mismatches']} of {row['tokens']} tokens differ, max ULP {row['ulp_max']}"]
            if row["mismatches"]
            else []
        )
        if not row["sync_bit_equal"] or any(row[c] for c, _ in STEP_CHECKS):
            problems.append(
                f"weight sync not bit-equal ({row['sync_tensors_differing']} tensors differ, "
                f"{row['sync_stale_packed']} packed GEMMs stale, {row['sync_replicas_diverged']} "
                "replicas diverged)"
            )
        if not row["train_forward_equal"]:
            problems.append("training forward != rescoring")
        # a sync or forward problem is among the verdict's reasons, so the case fails whatever the token rule
        cases.append(
            _case(
                f"step {row['step']}",
                row["nan_tokens"],
                "; ".join(problems) or None,
                passed,
                error,
                row["positive_tokens"],
            )
        )
    notes = (
        []
        if run.token_rows
        else [
            "no per-token rows (--no-token-rows): the counts are steps.parquet's, not "
            "recomputed from both engines' logprobs"
        ]
    )
    if run.record.get("stopped"):
        notes.append(
            f"steps {len(steps) + 1}..{run.record['rl']['steps']} (--max-seconds stopped the run after step "
            f"{len(steps)})"
        )
    step_rows = steps[["step", "tokens", "mismatches", "ulp_max", "sync_bit_equal", "nan_tokens"]].to_dict("records")
    return Verdict(
        passed,
        rule.describe() + "; every weight sync bit-equal",
        n,
        mismatches,
        ulp_max,
        max_abs,
        reasons,
        [],
        name,
        error,
        {},
        cases,
        [{k: _plain(v) for k, v in r.items()} for r in step_rows],
        notes=notes,
    )


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def _rule_reasons(rule: Rule, n: int, mismatches: int, ulp_max: int | None, max_abs: float | None) -> list[str]:
    reasons = []
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
    return reasons


def _case(
    name: str, nan_tokens: int, message: str | None, passed: bool, error: str | None, positive_tokens: int = 0
) -> dict:
    """A JUnit case: error with NaN or logprobs above 0; failure with a message when the verdict failed; a note
    when a relaxed rule passed despite it; pass otherwise."""
    if nan_tokens:
        return {"name": name, "status": "error", "message": f"{nan_tokens} NaN logprobs", "detail": error}
    if positive_tokens:
        return {"name": name, "status": "error", "message": f"{positive_tokens} logprobs above 0", "detail": error}
    if message:
        return {"name": name, "status": "note" if passed else "fail", "message": message}
    return {"name": name, "status": "pass", "message": None}


def _sequences(tokens: pd.DataFrame) -> list[dict]:
    rows = []
    for seq, g in tokens.groupby("seq", sort=True):
        bad = g[~g["bitwise_equal"]]
        nan = int((np.isnan(g["lp_train"].to_numpy()) | np.isnan(g["lp_infer"].to_numpy())).sum())
        row: dict[str, object] = {"seq": int(seq), "tokens": len(g), "mismatches": len(bad), "nan_tokens": nan}
        if len(bad):
            first = bad.sort_values("pos").iloc[0]
            lp = torch.tensor([first["lp_train"], first["lp_infer"]], dtype=torch.float32)
            row["first_mismatch"] = {
                "pos": int(first["pos"]),
                "token_id": int(first["token_id"]),
                "ulp": int(first["ulp"]),
                "train": float(first["lp_train"]),
                "infer": float(first["lp_infer"]),
                "train_hex": hex_bits(lp[0]),
                "infer_hex": hex_bits(lp[1]),
            }
        rows.append(row)
    return rows


def _first_message(row: dict) -> str:
    f = row["first_mismatch"]
    return (
        f"{row['mismatches']} of {row['tokens']} tokens differ; first at position {f['pos']} "
        f"(token {f['token_id']}): "
        f"train {f['train']:.9g} ({f['train_hex']}) vs infer {f['infer']:.9g} ({f['infer_hex']}), {f['ulp']} ULP"
    )


def junit_xml(verdict: Verdict, name: str = "alignaudit.gate") -> str:
    """JUnit XML: one test case per sequence (compare) or per step (rl). NaN is an <error>; a mismatch (or
    an rl step's weight sync that is not bit-equal) a <failure> when the verdict fails; under a relaxed rule
    that passes, mismatches are reported as system-out."""
    suite = ET.Element("testsuite", name=name)
    failures = errors = 0
    for c in verdict.cases:
        case = ET.SubElement(suite, "testcase", classname=name, name=c["name"])
        if c["status"] == "error":
            errors += 1
            kind = "NaNLogprob" if "NaN" in c["message"] else "NotALogprob"
            ET.SubElement(case, "error", message=c["message"], type=kind).text = c.get("detail")
        elif c["status"] == "fail":
            failures += 1
            ET.SubElement(case, "failure", message=c["message"], type="LogprobMismatch").text = (
                f"rule: {verdict.rule}\n" + "\n".join(verdict.reasons)
            )
        elif c["status"] == "note":
            ET.SubElement(case, "system-out").text = c["message"]
    tests = len(verdict.cases)
    if not verdict.passed and failures + errors == 0:  # failed on a rule that is not per case (e.g. baseline)
        case = ET.SubElement(suite, "testcase", classname=name, name="rule")
        ET.SubElement(case, "failure", message="; ".join(verdict.reasons), type="RuleViolation")
        tests, failures = tests + 1, 1
    suite.set("tests", str(tests))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


def write_outputs(verdict: Verdict, json_path: Path, junit_path: Path, md_path: Path, append_md: bool) -> None:
    """verdict.json, junit.xml and the Markdown summary (appended to an existing ``md_path`` with
    ``append_md``, as GitHub's $GITHUB_STEP_SUMMARY expects); missing parent directories are created.

    Raises:
        InputError: a path cannot be written.
    """
    try:
        for path in (json_path, junit_path, md_path):  # reports/alignment.xml in a fresh CI checkout
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(verdict.to_dict(), indent=2) + "\n")
        Path(junit_path).write_text(junit_xml(verdict))
        with open(md_path, "a" if append_md and Path(md_path).exists() else "w") as f:
            f.write(markdown(verdict))
    except OSError as e:
        raise InputError(
            f"cannot write the verdict to {e.filename}: {e.strerror}; pass --json, --junit and "
            "--markdown to write it elsewhere"
        ) from e


def markdown(verdict: Verdict, title: str = "alignaudit gate") -> str:
    """A Markdown summary for a CI job page (GitHub's $GITHUB_STEP_SUMMARY, GitLab's artifacts)."""
    icon = verdict.label.upper()
    lines = [
        f"### {title}: {icon}",
        "",
        f"Rule: {verdict.rule}.",
        "",
        "| tokens compared | mismatching | max ULP | max \\|d logprob\\| |",
        "|---|---|---|---|",
        f"| {verdict.tokens_compared} | {verdict.mismatches} | {verdict.ulp_max} | "
        f"{'-' if verdict.max_abs_diff is None else format(verdict.max_abs_diff, '.3e')} |",
        "",
    ]
    if verdict.error:
        lines += [f"- engine error: {verdict.error}", ""]
    if verdict.reasons:
        lines += [f"- {r}" for r in verdict.reasons] + [""]
    if verdict.notes:
        lines += [f"- not judged: {n}" for n in verdict.notes] + [""]
    failing = [c for c in verdict.cases if c["status"] != "pass"]
    if failing:
        lines += ["| case | result |", "|---|---|"]
        lines += [f"| {c['name']} | {c['status']}: {c['message']} |" for c in failing[:20]]
        if len(failing) > 20:
            lines.append(f"| ... | {len(failing) - 20} more |")
        lines.append("")
    return "\n".join(lines) + "\n"
