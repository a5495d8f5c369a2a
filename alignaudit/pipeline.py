"""Orchestration: capture with one engine, diff two captures, compare = capture + capture + diff, bisect.

Output of ``compare`` (and of ``diff``), in ``out``:
    run.json          the resolved configuration (written first)
    train/, infer/    the two capture directories (compare only)
    tokens.parquet    per-token comparison (diff.compare_tokens columns)
    summary.json      diff.summarize record, plus what was compared
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from alignaudit.capture import Capture
from alignaudit.diff import align_tokens, compare_tokens, summarize
from alignaudit.engines.base import EngineSettings
from alignaudit.errors import InputError
from alignaudit.models import ModelSpec, checkpoint_sha256
from alignaudit.opdiff import DIFFERS, compare_op, first_divergence
from alignaudit.ops import LOGPROBS, Selection, all_op_ids
from alignaudit.opstore import OpStore
from alignaudit.prompts import TokenBatch
from alignaudit.runner import run_capture

TOKENS = "tokens.parquet"
SUMMARY = "summary.json"
RUN = "run.json"
BISECT = "bisect.json"
MODES = ("natural", "forced", "both")


@dataclass
class EngineRun:
    """One side of a comparison: an engine name and its settings."""

    engine: str
    settings: EngineSettings

    def label(self) -> str:
        return f"{self.engine} ({self.settings.dtype}, {self.settings.device})"


OUTPUTS = ("run.json", "summary.json", "tokens.parquet", "bisect.json", "ops.parquet", "ops-natural.parquet",
           "ops-forced.parquet", "train", "infer", "infer-forced", "manifest.json", "logprobs.parquet", "ops",
           "request.json", "worker.log", "verdict.json", "junit.xml", "summary.md")


def prepare_output(out: Path, force: bool) -> Path:
    """Create ``out``. A non-empty directory is refused unless ``force``; then alignaudit's own outputs in
    it (OUTPUTS) are removed first, so no stale result survives beside the new one. Other files stay.

    Raises:
        InputError: ``out`` is a file, cannot be created, or is non-empty without ``force``.
    """
    import shutil

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise InputError(f"--out {out} is not empty; choose another directory or pass --force to overwrite")
        for name in OUTPUTS:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create --out {out}: {e.strerror}") from e
    return out


def write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def capture(spec: ModelSpec, batch: TokenBatch, run: EngineRun, out: Path, role: str | None = None,
            stream_log: bool = False, ops: Selection | None = None, reference: Path | None = None,
            rollout: dict | None = None) -> Capture:
    """Run one engine on ``batch`` in a worker process; the capture lands in ``out``.

    ``ops`` captures the selected canonical ops too; ``reference`` (a capture with ops of the same model
    and token ids) runs in forced mode: each op's inputs are the reference engine's values.
    """
    request = None
    if ops is not None:
        request = {"selection": ops.to_dict(), "reference": str(Path(reference).resolve()) if reference else None}
    return run_capture(run.engine, spec, batch, run.settings, out, role=role,
                       checkpoint_sha256=checkpoint_sha256(spec), stream_log=stream_log, ops=request, rollout=rollout)


def diff_captures(train: Capture, infer: Capture, out: Path, clip_eps: float = 0.2) -> dict:
    """Compare two captures of the same checkpoint and token ids; write tokens.parquet and summary.json.

    Raises:
        InputError: the captures are of different checkpoints or token ids.
    """
    sha_t = train.manifest["model"].get("checkpoint_sha256")
    sha_i = infer.manifest["model"].get("checkpoint_sha256")
    if sha_t != sha_i:
        raise InputError(
            f"the captures are of different checkpoints ({train.path}: {str(sha_t)[:12]}, "
            f"{infer.path}: {str(sha_i)[:12]}); capture both from one --model"
        )
    if train.manifest["prompts"]["digest"] != infer.manifest["prompts"]["digest"]:
        raise InputError("the two captures were made on different token ids; capture both from the same prompts")
    tokens = compare_tokens(align_tokens(train.logprobs, infer.logprobs))
    summary = summarize(tokens, clip_eps=clip_eps)
    summary["model"] = train.manifest["model"]["name"]
    summary["sides"] = {role: _side(c) for role, c in (("train", train), ("infer", infer))}
    out.mkdir(parents=True, exist_ok=True)
    tokens.to_parquet(out / TOKENS, index=False)
    write_json(out / SUMMARY, summary)
    return summary


def compare(spec: ModelSpec, batch: TokenBatch, train: EngineRun, infer: EngineRun, out: Path,
            clip_eps: float = 0.2, stream_log: bool = False, on_stage=None, rollout: dict | None = None) -> dict:
    """Capture ``train`` and ``infer`` on the same token ids, then diff them into ``out``.

    Prompt mode (``rollout`` None): both engines score the prompts teacher-forced. Rollout mode: the
    inference engine samples completions (``rollout``: max_new_tokens, temperature, seed) and records
    their logprobs while decoding; the training engine then scores prompt + completion in one pass.
    """
    write_json(out / RUN, {
        "command": "compare",
        "mode": "rollout" if rollout else "prompt",
        "rollout": rollout,
        "model": spec.to_dict(),
        "prompts": {"source": batch.source, "sequences": len(batch.sequences), "tokens": batch.num_tokens},
        "train": {"engine": train.engine, **train.settings.to_dict()},
        "infer": {"engine": infer.engine, **infer.settings.to_dict()},
        "clip_eps": clip_eps,
    })

    def stage(run: EngineRun, role: str) -> None:
        if on_stage:
            on_stage(f"running {run.label()} as the {role} engine")

    if rollout:
        stage(infer, "inference (sampling)")
        infer_capture = capture(spec, batch, infer, out / "infer", role="infer", stream_log=stream_log, rollout=rollout)
        batch = infer_capture.token_batch()
        stage(train, "training")
        train_capture = capture(spec, batch, train, out / "train", role="train", stream_log=stream_log)
    else:
        stage(train, "training")
        train_capture = capture(spec, batch, train, out / "train", role="train", stream_log=stream_log)
        stage(infer, "inference")
        infer_capture = capture(spec, batch, infer, out / "infer", role="infer", stream_log=stream_log)
    return diff_captures(train_capture, infer_capture, out, clip_eps=clip_eps)


def _side(c: Capture) -> dict:
    s = c.manifest["settings"]
    return {"engine": c.engine, "dtype": s["dtype"], "device": s["device"], "capture": str(c.path),
            "options": s.get("options", {})}


def diff_ops(train: Capture, infer: Capture, selection: Selection | None = None) -> list[dict]:
    """Compare the ops of ``selection`` (default: every op either capture holds) in topological order,
    logprobs last."""
    store_a, store_b = OpStore(train.path), OpStore(infer.path)
    records = []
    for op in all_op_ids(train.manifest["model"]["num_layers"]):
        if op == LOGPROBS:
            records.append(compare_op(op, train.logprob_sequences(), infer.logprob_sequences()))
        elif selection.wants(op) if selection is not None else (store_a.has(op) or store_b.has(op)):
            records.append(compare_op(op, store_a.sequences(op), store_b.sequences(op)))
    return records


def write_ops(records: list[dict], path: Path) -> None:
    table = pd.DataFrame([{**r, "worst": json.dumps(r.get("worst")) if r.get("worst") else None} for r in records])
    table.to_parquet(path, index=False)


def bisect(spec: ModelSpec, batch: TokenBatch, train: EngineRun, infer: EngineRun, out: Path,
           selection: Selection, mode: str = "both", stream_log: bool = False, on_stage=None) -> dict:
    """Capture canonical ops of both engines and compare them op by op.

    natural: both engines run freely; differences accumulate, and the first differing op is where they
        start to diverge. forced: the infer engine runs with every captured op's inputs replaced by the
        train engine's values, so each op's difference is its own (local); this lists every op that
        computes differently. both: the two, sharing the train capture.
    Writes train/, infer/ and/or infer-forced/, ops-natural.parquet / ops-forced.parquet, bisect.json.
    """
    if mode not in MODES:
        raise InputError(f"unknown bisect mode {mode!r}; choose one of {', '.join(MODES)}")
    write_json(out / RUN, {
        "command": "bisect", "mode": mode, "model": spec.to_dict(), "selection": selection.to_dict(),
        "prompts": {"source": batch.source, "sequences": len(batch.sequences), "tokens": batch.num_tokens},
        "train": {"engine": train.engine, **train.settings.to_dict()},
        "infer": {"engine": infer.engine, **infer.settings.to_dict()},
    })

    def stage(msg: str) -> None:
        if on_stage:
            on_stage(msg)

    stage(f"capturing ops of {train.label()} (train)")
    # Forced mode feeds each selected op the train engine's inputs, so those are captured too.
    train_ops = selection.with_inputs(spec.num_layers) if mode != "natural" else selection
    reference = capture(spec, batch, train, out / "train", role="train", stream_log=stream_log, ops=train_ops)
    result: dict = {"model": spec.name, "sides": {"train": _side(reference)}}
    runs = [("natural", out / "infer", None)] if mode in ("natural", "both") else []
    runs += [("forced", out / "infer-forced", reference.path)] if mode in ("forced", "both") else []
    for name, directory, ref in runs:
        stage(f"capturing ops of {infer.label()} (infer, {name})")
        other = capture(spec, batch, infer, directory, role="infer", stream_log=stream_log, ops=selection,
                        reference=ref)
        records = diff_ops(reference, other, selection)
        write_ops(records, out / f"ops-{name}.parquet")
        first = first_divergence(records)
        result["sides"]["infer"] = _side(other)
        result[name] = {
            "ops_compared": len(records),
            "differing_ops": [r["op"] for r in records if r["status"] == DIFFERS],
            "first_divergence": first,
            "substituted_ops": other.manifest["ops"].get("substituted_ops"),
            "records": records,
        }
    write_json(out / BISECT, result)
    return result
