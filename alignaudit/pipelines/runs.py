"""Orchestration: capture with one engine, diff two captures, compare = capture + capture + diff, bisect.

Output of ``compare`` (and of ``diff``), in ``out``:
    run.json           the resolved configuration, written first with "status": "running"; when the run
                       ends, "status": "complete" and the sha256 of each capture's manifest
    train/, infer/     the two capture directories (compare only)
    tokens.parquet     per-token comparison (diff.compare_tokens columns)
    sequences.parquet  per-sequence rows (diff.per_sequence)
    summary.json       diff.summarize record, plus what was compared
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from alignaudit.capture.directory import Capture
from alignaudit.capture.op_store import OpStore
from alignaudit.capture.ops import LOGPROBS, OpGraph, Selection
from alignaudit.capture.rundir import BISECT, DIFF_OUTPUTS, OPS_FILES, RUN, SEQUENCES, SUMMARY, TOKENS, UNREPLAYED
from alignaudit.comparison.integrity import capture_record, manifest_sha256, marks_failure, seal
from alignaudit.comparison.op_diff import DIFFERS, compare_op, first_divergence, routing_agreement
from alignaudit.comparison.repeat import summarize_repeats
from alignaudit.comparison.summary import Summary
from alignaudit.comparison.token_diff import align_tokens, compare_tokens, per_sequence, summarize
from alignaudit.comparison.vocab import vocab_columns
from alignaudit.engines.checks import processed_logprobs, routing_observable
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec, checkpoint_sha256
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import EngineRun, ISThresholds, Replay, Request, Sampling
from alignaudit.workers.job import CaptureJob, OpsRequest
from alignaudit.workers.spawn import run_capture

MODES = ("natural", "forced", "both")
ROUTING = Selection(names=frozenset({"routing"}))  # what compare captures of a mixture-of-experts model

__all__ = ["EngineRun", "capture", "compare", "bisect", "diff_captures", "diff_ops", "finish_diff"]


def write_json(path: Path, record: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def capture(
    spec: ModelSpec,
    batch: TokenBatch,
    run: EngineRun,
    out: Path,
    role: str | None = None,
    stream_log: bool = False,
    ops: Selection | None = None,
    reference: Path | None = None,
    rollout: Sampling | None = None,
    replay: Replay | None = None,
    repeat: int = 1,
    full_vocab: bool = False,
    on_progress=None,
    routing_from: Path | None = None,
) -> Capture:
    """Run one engine on ``batch`` in a worker process (alignaudit.workers.job.CaptureJob); the capture lands in
    ``out``.

    ``ops`` captures the selected canonical ops too; ``reference`` (a capture with ops of the same model
    and token ids) runs in forced mode: each op's inputs are the reference engine's values. ``rollout``
    samples completions; ``replay`` makes a trainer score the generated tokens under the sampling transform.
    ``repeat`` > 1 (prompt mode) runs the engine again on the same token ids, also among random filler sequences
    (alignaudit.workers.repeats). ``routing_from``: a capture with the ``routing`` op whose experts the engine's MoE
    router replays. ``full_vocab`` (prompt mode) also writes every scored position's full log-softmax row
    (alignaudit.capture.vocab_rows). ``on_progress(done, total)`` receives sequence counts.
    """
    job = CaptureJob(
        run.engine,
        spec,
        run.settings,
        batch,
        Path(out).resolve(),
        role=role,
        checkpoint_sha256=checkpoint_sha256(spec),
        ops=OpsRequest(ops, Path(reference).resolve() if reference else None) if ops is not None else None,
        rollout=rollout,
        replay=replay,
        routing_from=Path(routing_from).resolve() if routing_from else None,
        repeat=repeat,
        full_vocab=full_vocab,
    )
    return run_capture(job, stream_log=stream_log, on_progress=on_progress)


def diff_captures(
    train: Capture,
    infer: Capture,
    out: Path,
    clip_eps: float = 0.2,
    routing_note: str | None = None,
    importance: ISThresholds | None = None,
) -> Summary:
    """Compare two captures (checked by alignaudit.comparison.integrity first); write tokens.parquet, sequences.parquet
    and summary.json. ``routing_note``: why a mixture-of-experts comparison holds no routing (the captures
    were made without it). ``importance``: the IS diagnostics' thresholds (default ISThresholds())."""
    tokens, sequences, summary = comparison(train, infer, clip_eps, importance)
    if "routing" not in summary and routing_note:
        summary["routing_note"] = routing_note
    out.mkdir(parents=True, exist_ok=True)
    tokens.to_parquet(out / TOKENS, index=False)
    sequences.to_parquet(out / SEQUENCES, index=False)
    write_json(out / SUMMARY, summary)
    return summary


def comparison(
    train: Capture, infer: Capture, clip_eps: float = 0.2, importance: ISThresholds | None = None
) -> tuple[pd.DataFrame, pd.DataFrame, Summary]:
    """(tokens, sequences, summary) of two captures, nothing written: per-token comparison, per-sequence rows, the
    summarize record (IS diagnostics at ``importance``'s thresholds) with the model, both sides, repeats and, where
    both captures hold routing, ``routing``. When both captures hold full-vocabulary rows, the tokens gain the
    alignaudit.comparison.vocab columns and the summary its ``vocab`` record (with each side's row formula); when
    only one does, ``vocab_note`` says so.

    Raises:
        InputError: the captures do not hold the same token ids, or a row file is missing or damaged.
    """
    tokens = compare_tokens(align_tokens(train.logprobs, infer.logprobs))
    if train.has_vocab_rows and infer.has_vocab_rows:  # both captured with --full-vocab
        tokens = vocab_columns(tokens, train.vocab_rows, infer.vocab_rows)
    sequences = per_sequence(tokens)
    summary = summarize(tokens, clip_eps=clip_eps, sequences=sequences, importance=importance)
    if "vocab" in summary:
        summary["vocab"]["rows"] = {
            role: c.manifest["vocab"]["rows"] for role, c in (("train", train), ("infer", infer))
        }
    elif train.has_vocab_rows or infer.has_vocab_rows:
        summary["vocab_note"] = (
            f"only the {'train' if train.has_vocab_rows else 'infer'} capture holds "
            "full-vocabulary rows; capture both with --full-vocab"
        )
    summary["model"] = train.manifest["model"]["name"]
    summary["sides"] = {role: _side(c) for role, c in (("train", train), ("infer", infer))}
    if note := attention_note(summary["sides"]):
        summary["attention_note"] = note
    repeats = {
        role: summarize_repeats(c.manifest["repeats"])
        for role, c in (("train", train), ("infer", infer))
        if c.manifest.get("repeats")
    }
    if repeats:
        summary["repeats"] = repeats
    if train.manifest.get("ops") and infer.manifest.get("ops") and train.manifest["model"].get("num_experts"):
        summary["routing"] = routing_agreement(diff_ops(train, infer, ROUTING))
    return tokens, sequences, summary


@marks_failure
def compare(request: Request, out: Path, stream_log: bool = False, on_stage=None) -> Summary:
    """Capture ``request.train`` and ``request.infer`` on the same token ids, then diff them into ``out``. The request
    is trusted as built (alignaudit.pipelines.requests.build_request checked every setting before any engine started).

    Prompt mode: both engines score the prompts teacher-forced. Rollout mode: the inference engine samples
    completions and records their logprobs while decoding; the training engine then scores prompt +
    completion in one pass; when the rollout engine records processed logprobs (vLLM
    ``logprobs_mode=processed_logprobs``), the trainer scores the generated tokens under the same sampling
    transform (temperature, top-k, top-p), as RL trainers do. ``request.full_vocab`` (prompt mode) has both engines
    record their full log-softmax rows, and the diff adds the per-position divergence of the two distributions
    (alignaudit.comparison.vocab). ``on_stage(text)`` receives progress lines.
    """
    record = {**request.record("compare"), "status": "running"}
    write_json(out / RUN, record)

    def stage(run: EngineRun, role: str):
        if on_stage:
            on_stage(f"running {run.label()} as the {role} engine")
            return lambda done, total: on_stage(f"running {run.label()} as the {role} engine: {done}/{total} sequences")
        return None

    if request.replay_routing:
        return _compare_replayed(request, out, record, stream_log, stage)
    rollout = request.rollout
    batch = request.batch
    ops, note = routing_plan(request.spec, request.train, request.infer, rollout=rollout is not None)
    if rollout is not None:
        infer_capture = capture(
            request.spec,
            batch,
            request.infer,
            out / "infer",
            role="infer",
            stream_log=stream_log,
            rollout=rollout,
            on_progress=stage(request.infer, "inference (sampling)"),
        )
        batch = infer_capture.token_batch()
        replay = None
        if processed_logprobs(request.infer):  # the rollout recorded processed logprobs: the trainer replays
            replay = Replay.of(rollout.to_dict(), infer_capture.manifest["rollout"]["prompt_lengths"])
        train_capture = capture(
            request.spec,
            batch,
            request.train,
            out / "train",
            role="train",
            stream_log=stream_log,
            replay=replay,
            on_progress=stage(request.train, "training"),
        )
    else:
        train_capture = capture(
            request.spec,
            batch,
            request.train,
            out / "train",
            role="train",
            stream_log=stream_log,
            ops=ops,
            repeat=request.repeat,
            full_vocab=request.full_vocab,
            on_progress=stage(request.train, "training"),
        )
        infer_capture = capture(
            request.spec,
            batch,
            request.infer,
            out / "infer",
            role="infer",
            stream_log=stream_log,
            ops=ops,
            repeat=request.repeat,
            full_vocab=request.full_vocab,
            on_progress=stage(request.infer, "inference"),
        )
    summary = diff_captures(
        train_capture, infer_capture, out, clip_eps=request.clip_eps, routing_note=note, importance=request.importance
    )
    finish_run(out, record, {"train": train_capture, "infer": infer_capture}, (TOKENS, SEQUENCES, SUMMARY))
    return summary


def _compare_replayed(request: Request, out: Path, record: dict, stream_log: bool, stage) -> Summary:
    """compare --replay-routing (prompt mode): the infer engine first, its routing captured; the train engine
    twice, on its own routing (``train-unreplayed/``) and replaying the infer engine's (``train/``, the run's
    train side); both compared with the infer capture, the second written as the run's comparison and the first
    summarized in summary["routing_replay"] (routing_replay_record)."""
    infer_capture = capture(
        request.spec,
        request.batch,
        request.infer,
        out / "infer",
        role="infer",
        on_progress=stage(request.infer, "inference"),
        stream_log=stream_log,
        ops=ROUTING,
    )
    unreplayed = capture(
        request.spec,
        request.batch,
        request.train,
        out / UNREPLAYED,
        role="train",
        on_progress=stage(request.train, "training (own routing)"),
        stream_log=stream_log,
        ops=ROUTING,
    )
    train_capture = capture(
        request.spec,
        request.batch,
        request.train,
        out / "train",
        role="train",
        routing_from=infer_capture.path,
        on_progress=stage(request.train, "training (routing replayed)"),
        stream_log=stream_log,
        ops=ROUTING,
    )
    before = comparison(unreplayed, infer_capture, request.clip_eps, request.importance)[2]
    summary = diff_captures(train_capture, infer_capture, out, clip_eps=request.clip_eps, importance=request.importance)
    changed = summarize(compare_tokens(align_tokens(unreplayed.logprobs, train_capture.logprobs)))["mismatches"]
    summary["routing_replay"] = routing_replay_record(before, summary, changed, train_capture)
    write_json(out / SUMMARY, summary)
    record["routing_replay"] = {"unreplayed": capture_record(unreplayed)}
    finish_run(out, record, {"train": train_capture, "infer": infer_capture}, (TOKENS, SEQUENCES, SUMMARY))
    return summary


def routing_replay_record(before: Mapping[str, Any], after: Mapping[str, Any], changed: int, train: Capture) -> dict:
    """summary["routing_replay"]: the comparison with the train engine's own routing (``before``, a summarize
    record with ``routing``) and with the infer engine's routing replayed (``after``): tokens rerouted (all MoE
    layers; per layer in ``routing_before`` / ``routing_after``), logprob mismatches, max ULP and max |diff|,
    the RL metrics' token_mult_prob_error; ``tokens_changed_by_replay``: tokens whose train logprob the replay
    changed (bitwise); ``mechanism``: how the trainer replayed (its capture's engine settings)."""
    record = {
        "rerouted_before": sum(r["rerouted"] for r in before["routing"]),
        "rerouted_after": sum(r["rerouted"] for r in after["routing"]),
        "tokens_compared": after["tokens_compared"],
    }
    for key in ("mismatches", "ulp_max", "max_abs_diff"):
        record[f"{key}_before"], record[f"{key}_after"] = before[key], after[key]
    record["token_mult_prob_error_before"] = before["rl"]["token_mult_prob_error"]
    record["token_mult_prob_error_after"] = after["rl"]["token_mult_prob_error"]
    record["tokens_changed_by_replay"] = changed
    record["routing_before"], record["routing_after"] = before["routing"], after["routing"]
    record["mechanism"] = train.manifest["engine_settings"].get("routing_replay")
    return record


# What a rollout file's capture records of the engine that made it: nothing the file does not say.
FILE_SETTINGS: dict[str, object] = {
    "dtype": None,
    "device": None,
    "seed": None,
    "options": {},
    "strict": None,
    "lm_head_dtype": None,
    "strict_exp": None,
    "strict_attention": None,
}


@marks_failure
def rescore(
    spec: ModelSpec,
    rollouts,
    train: EngineRun,
    out: Path,
    clip_eps: float = 0.2,
    stream_log: bool = False,
    on_stage=None,
) -> Summary:
    """``alignaudit rescore``: the training engine scores the token ids of rollouts an RL framework recorded
    (alignaudit.inputs.rollouts.Rollouts), and its logprobs of the sampled tokens are compared with the file's.

    ``out`` gets what ``compare --mode rollout`` writes: ``infer/`` (the file as a capture, engine "rollout-file",
    the sampled tokens scored only), ``train/``, tokens.parquet, sequences.parquet, summary.json (over the sampled
    tokens) and a sealed run.json that gate checks against both captures and the file's sha256. Where the file's
    logprobs are processed, the trainer replays its temperature, top-k and top-p, as compare does.

    """
    from alignaudit.capture.directory import SCORED_GENERATED, read_capture, rollout_file_table, write_capture

    replay = None
    if rollouts.processed:
        replay = Replay.of(rollouts.sampling, rollouts.prompt_lengths)
    sampling = dict(rollouts.sampling)
    record = {
        "command": "rescore",
        "mode": "rollout",
        "rollout": sampling,
        "model": spec.to_dict(),
        "prompts": {
            "source": rollouts.batch.source,
            "sequences": len(rollouts.batch.sequences),
            "tokens": rollouts.batch.num_tokens,
            "digest": rollouts.batch.digest(),
        },
        "train": train.record(),
        "infer": {"engine": "rollout-file", **FILE_SETTINGS},
        "clip_eps": clip_eps,
        "source": rollouts.source,
        "rollout_assumed": list(rollouts.assumed),
        "status": "running",
    }
    write_json(out / RUN, record)
    batch = rollouts.batch
    manifest = {
        "engine": "rollout-file",
        "role": "infer",
        "model": {**spec.to_dict(), "checkpoint_sha256": checkpoint_sha256(spec)},
        "settings": FILE_SETTINGS,
        "engine_settings": {"source": rollouts.source},
        "mode": "rollout",
        "rollout": {**sampling, "prompt_lengths": rollouts.prompt_lengths},
        "replay": None,
        "scored": SCORED_GENERATED,
        "prompts": {
            "source": batch.source,
            "num_sequences": len(batch.sequences),
            "num_tokens": batch.num_tokens,
            "digest": batch.digest(),
            "texts": [],
        },
    }
    write_capture(out / "infer", manifest, rollout_file_table(batch, rollouts.prompt_lengths, rollouts.logprobs))
    infer_capture = read_capture(out / "infer")
    if on_stage:
        on_stage(f"running {train.label()} as the training engine")
    train_capture = capture(spec, batch, train, out / "train", role="train", stream_log=stream_log, replay=replay)
    summary = diff_captures(train_capture, infer_capture, out, clip_eps=clip_eps)
    finish_run(out, record, {"train": train_capture, "infer": infer_capture}, (TOKENS, SEQUENCES, SUMMARY))
    return summary


ROUTING_NOTE = (
    "vLLM's compiled default MoE runs its routing inside the compiled graph, where no hook sees it; "
    "alignaudit bisect reads it in eager mode"
)


def routing_plan(
    spec: ModelSpec, train: EngineRun, infer: EngineRun, rollout: bool
) -> tuple[Selection | None, str | None]:
    """What a comparison captures besides logprobs, and why not more: (ROUTING, None) for a mixture-of-experts
    model in prompt mode when both engines' routing can be read without changing what they compute; else
    (None, the reason the summary gives for holding no routing), and (None, None) for a dense model."""
    if not spec.num_experts:
        return None, None
    if rollout:
        return None, "prompt mode only"
    if all(map(routing_observable, (train, infer))):
        return ROUTING, None
    return None, ROUTING_NOTE


def finish_run(out: Path, record: dict, captures: dict[str, Capture], outputs: tuple[str, ...]) -> None:
    """Seal run.json (alignaudit.comparison.integrity.seal): complete, with what identifies each capture the run
    wrote and the sha256 of each of its ``outputs``."""
    write_json(
        out / RUN, seal({**record, "captures": {role: capture_record(c) for role, c in captures.items()}}, out, outputs)
    )


def finish_diff(out: Path, train: Capture, infer: Capture, clip_eps: float) -> None:
    """The record of a ``diff`` directory, sealed: the two captures by path and manifest sha256 (so gate and
    report can check the comparison against them) and the sha256 of each output."""
    record = {
        "command": "diff",
        "clip_eps": clip_eps,
        "model": {"name": train.manifest["model"]["name"]},
        "captures": {
            role: {"path": str(c.path.resolve()), "manifest_sha256": manifest_sha256(c.path)}
            for role, c in (("train", train), ("infer", infer))
        },
    }
    write_json(out / RUN, seal(record, out, DIFF_OUTPUTS))


def attention_note(sides: dict) -> str | None:
    """Where the two sides' strict attention ran different kernels (alignaudit_kernels.attention.KERNELS: each its own
    algorithm, so their attention bits differ by construction), a line saying so; None otherwise."""
    kernels = {role: side.get("strict_attention") for role, side in sides.items()}
    if None in kernels.values() or len(set(kernels.values())) < 2:
        return None
    return (
        f"strict attention ran the {kernels['train']} kernel in the train capture and the {kernels['infer']} "
        "kernel in the infer capture: two algorithms, whose bits differ by construction; capture both with one "
        "--strict-attention"
    )


def _attention_kernel(engine_settings: dict) -> str | None:
    """The strict attention kernel a capture's manifest records; a capture made before the kernel was recorded ran
    strict attention (an exp recorded) with the only kernel there was, the portable one; None without strict
    attention."""
    if engine_settings.get("attention_kernel"):
        return engine_settings["attention_kernel"]
    return "portable" if engine_settings.get("attention_exp") else None


def _side(c: Capture) -> dict:
    from alignaudit.engines import KINDS

    s = c.manifest["settings"]
    kind = KINDS.get(c.engine)
    return {
        "engine": c.engine,
        "dtype": s["dtype"],
        "device": s["device"],
        "strict": s.get("strict", ""),
        "strict_exp": c.manifest.get("engine_settings", {}).get("attention_exp"),
        "strict_attention": _attention_kernel(c.manifest.get("engine_settings", {})),
        "lm_head_dtype": s.get("lm_head_dtype", "model"),
        "capture": str(c.path),
        "options": s.get("options", {}),
        "tensor_parallel_size": s.get("options", {}).get(kind.tp_option, 1) if kind and kind.tp_option else 1,
    }


def diff_ops(train: Capture, infer: Capture, selection: Selection | None = None) -> list[dict]:
    """Compare the ops of ``selection`` (default: every op either capture holds) in topological order,
    logprobs last. Ops the infer capture ran without forced inputs (forced mode, ``unforced_ops``) are
    marked ``note: inputs not forced`` and ``forced: False``."""
    store_a, store_b = OpStore(train.path, train.manifest.get("ops")), OpStore(infer.path, infer.manifest.get("ops"))
    ops = infer.manifest.get("ops") or {}
    unforced = set(ops.get("unforced_ops") or ())
    if ops.get("mode") == "forced" and not store_a.has("logits"):
        unforced.add(LOGPROBS)  # computed from the engine's own logits: the reference held none to force
    records = []
    model = train.manifest["model"]
    for op in OpGraph.of(model).op_ids():
        if op == LOGPROBS:
            record = compare_op(op, train.logprob_sequences(), infer.logprob_sequences())
        elif selection.wants(op) if selection is not None else (store_a.has(op) or store_b.has(op)):
            record = compare_op(op, store_a.sequences(op), store_b.sequences(op))
        else:
            continue
        if op in unforced:
            record["forced"] = False
            record["note"] = "; ".join(n for n in (record.get("note"), "inputs not forced") if n)
        records.append(record)
    return records


def write_ops(records: list[dict], path: Path) -> None:
    table = pd.DataFrame([{**r, "worst": json.dumps(r.get("worst")) if r.get("worst") else None} for r in records])
    table.to_parquet(path, index=False)


@marks_failure
def bisect(
    request: Request, out: Path, selection: Selection, mode: str = "both", stream_log: bool = False, on_stage=None
) -> dict:
    """Capture canonical ops of both engines and compare them op by op.

    natural: both engines run freely; differences accumulate, and the first differing op is where they
        start to diverge. forced: the infer engine runs with every captured op's inputs replaced by the
        train engine's values, so each op's difference is its own (local); this lists every op that
        computes differently. both: the two, sharing the train capture.
    Writes train/, infer/ and/or infer-forced/, ops-natural.parquet / ops-forced.parquet, bisect.json.
    Where op capture made an engine run otherwise than asked (vLLM: eager, prefix caching off; the capture's
    ``capture_overrides``), that engine runs again as configured (ROLE-as-configured/) and bisect.json's
    ``as_configured`` says in how many tokens its logprobs differ from the captured run's.
    """

    if mode not in MODES:
        raise InputError(f"unknown bisect mode {mode!r}; choose one of {', '.join(MODES)}")
    spec, batch, train, infer = request.spec, request.batch, request.train, request.infer
    record = {**request.record("bisect"), "bisect_mode": mode, "selection": selection.to_dict(), "status": "running"}
    write_json(out / RUN, record)

    def stage(msg: str) -> None:
        if on_stage:
            on_stage(msg)

    stage(f"capturing ops of {train.label()} (train)")
    # Forced mode feeds each selected op the train engine's inputs, so those are captured too.
    train_ops = selection.with_inputs(OpGraph.of(spec)) if mode != "natural" else selection
    reference = capture(spec, batch, train, out / "train", role="train", stream_log=stream_log, ops=train_ops)
    result: dict = {"model": spec.name, "sides": {"train": _side(reference)}}
    runs: list[tuple[str, Path, Path | None]] = (
        [("natural", out / "infer", None)] if mode in ("natural", "both") else []
    )
    runs += [("forced", out / "infer-forced", reference.path)] if mode in ("forced", "both") else []
    captures = {"train": reference}
    for name, directory, ref in runs:
        stage(f"capturing ops of {infer.label()} (infer, {name})")
        other = capture(
            spec, batch, infer, directory, role="infer", stream_log=stream_log, ops=selection, reference=ref
        )
        captures["infer" if name == "natural" else "infer-forced"] = other
        records = diff_ops(reference, other, selection)
        write_ops(records, out / OPS_FILES[name])
        verdict = [r for r in records if r.get("forced", True)]
        result["sides"]["infer"] = _side(other)
        result[name] = {
            "ops_compared": len(verdict),
            "differing_ops": [r["op"] for r in verdict if r["status"] == DIFFERS],
            "unforced_ops": [r["op"] for r in records if not r.get("forced", True)],
            "first_divergence": first_divergence(verdict),
            "routing": routing_agreement(records),
            "substituted_ops": other.manifest["ops"].get("substituted_ops"),
            "records": records,
        }
    for role, run, made in (("train", train, reference), ("infer", infer, captures.get("infer"))):
        overrides = (made or captures["infer-forced"]).manifest.get("engine_settings", {}).get("capture_overrides")
        if not overrides:
            continue
        entry = result.setdefault("as_configured", {})[role] = {
            "engine": run.engine,
            "overrides": overrides,
            "tokens": None,
            "mismatches": None,
        }
        if made is None:  # forced mode only: its logprobs follow the forced inputs, nothing to compare them with
            continue
        stage(f"running {run.label()} ({role}) as configured, without op capture")
        plain = capture(spec, batch, run, out / f"{role}-as-configured", role=role, stream_log=stream_log)
        captures[f"{role}-as-configured"] = plain
        tokens = compare_tokens(align_tokens(made.logprobs, plain.logprobs))
        entry.update(tokens=len(tokens), mismatches=int((~tokens["bitwise_equal"]).sum()))
    write_json(out / BISECT, result)
    finish_run(out, record, captures, (OPS_FILES["natural"], OPS_FILES["forced"], BISECT))
    return result
