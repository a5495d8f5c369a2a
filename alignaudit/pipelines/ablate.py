"""alignaudit ablate: how much each op's kernel contributes to the disagreement of two engines.

One configuration per row, each run end to end as a comparison (the same token ids, both engines):
    all strict      every strict op in both engines (the reference: 0 mismatches when the strict path holds)
    default <op>    every strict op but <op>, left at each engine's own kernel: what <op> alone costs
    strict <op>     <op> alone strict: what <op> alone fixes
    all default     no strict op (what compare reports without --strict)
The strict kernels fix the four sources of disagreement (reduction order, intermediate precision, rounding
points, math primitives) together, op by op; there is no switch for one source inside a kernel, so the
factors are ops. In prompt mode every canonical op is captured too (natural mode, as bisect does), and the
row names the first op whose outputs differ; vLLM then runs eager, as all op capture needs (--no-ops keeps
each engine as it is and leaves that column empty).

Output, in ``out``: ``configs/<row>/`` (the comparison of each row: train/, infer/, summary.json, ...),
``ablate.parquet`` (ABLATE_COLUMNS, one row per configuration) and ``ablate.json`` (the same rows and what
was run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from alignaudit.capture import outdir
from alignaudit.capture.directory import read_capture
from alignaudit.capture.ops import Selection
from alignaudit.capture.rundir import (
    ABLATE_JSON,
    ABLATE_PARQUET,
    BISECT_OUTPUTS,
    COMPARE_OUTPUTS,
    CONFIGS,
    DIFF_OUTPUTS,
    RUN,
)
from alignaudit.comparison.integrity import marks_failure, seal
from alignaudit.inputs.request import EngineRun, Request
from alignaudit.inputs.strict_ops import STRICT_OPS, format_strict
from alignaudit.pipelines.runs import diff_captures, write_json

ABLATE_COLUMNS = ("factor", "kind", "strict", "mismatches", "tokens", "max_ulp", "max_abs_diff", "first_diverging_op")

# The canonical ops (alignaudit.capture.ops) each strict op computes, in every engine.
STRICT_OP_COVERS: dict[str, frozenset[str]] = {
    "linear": frozenset(
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "logits", "router", "moe"}
    ),
    "rmsnorm": frozenset({"input_norm", "q_norm", "k_norm", "post_attn_norm", "final_norm"}),
    "rope": frozenset({"q_rope", "k_rope"}),
    "silu": frozenset({"act"}),
    "attention": frozenset({"attn"}),
    "logprobs": frozenset({"logprobs"}),
}


@dataclass(frozen=True)
class Configuration:
    """One row: ``factor`` (an op, or "all"/"none"), ``kind`` and the strict ops both engines run."""

    factor: str
    kind: str
    strict: frozenset[str]

    @property
    def name(self) -> str:
        return {"all strict": "all-strict", "all default": "all-default"}.get(
            self.kind
        ) or f"{self.kind.split()[0]}-{self.factor}"


def configurations(factors: tuple[str, ...]) -> list[Configuration]:
    """The rows for ``factors`` (strict ops, alignaudit.inputs.strict_ops.STRICT_OPS order): all strict, each factor at
    its default, each factor alone strict, all default."""
    every = frozenset(STRICT_OPS)
    return (
        [Configuration("all", "all strict", every)]
        + [Configuration(op, "default op", every - {op}) for op in factors]
        + [Configuration(op, "strict op", frozenset({op})) for op in factors]
        + [Configuration("none", "all default", frozenset())]
    )


def with_strict(request: Request, ops: frozenset[str]) -> Request:
    """``request`` with the strict ops ``ops`` on both sides."""

    def run(side: EngineRun) -> EngineRun:
        return replace(side, settings=replace(side.settings, strict=format_strict(ops)))

    return replace(request, train=run(request.train), infer=run(request.infer))


def without_strict(request: Request) -> Request:
    """``request`` with no strict op on either side: what ablate records (each row sets its own)."""
    return with_strict(request, frozenset())


def eager_for_op_capture(request: Request) -> str:
    """The engines of ``request`` that op capture runs eager instead of as their compiled default ("" if none),
    as prose names them."""
    from alignaudit.engines import kind_of

    kinds = dict.fromkeys(kind_of(run.engine) for run in (request.train, request.infer))
    return " and ".join(k.display for k in kinds if k.eager_for_op_capture)


def _notes(request: Request, capture_ops: bool) -> list[str]:
    """What a reader of the matrix must know about how it was measured."""
    notes = [f"{request.mode} mode"]
    if capture_ops and (eager := eager_for_op_capture(request)):
        notes.append(
            f"{eager} ran eager in every row (op capture needs it); its compiled default computes other "
            "bits, so the all-default row can differ from `alignaudit compare`"
        )
    if not capture_ops:
        notes.append("no op capture: first_diverging_op is empty in every row, not 'no divergence'")
    return notes


@marks_failure
def ablate(
    request: Request, out: Path, factors: tuple[str, ...], capture_ops: bool = True, on_stage=None
) -> pd.DataFrame:
    """Run every configuration of ``factors`` on ``request`` (its engines' own strict setting is ignored) and
    write ablate.parquet / ablate.json into ``out``; returns the matrix (ABLATE_COLUMNS).

    ``capture_ops`` (prompt mode only): capture every canonical op and name each row's first diverging op.
    """
    from alignaudit.pipelines.runs import bisect, compare

    request = without_strict(request)
    rows_of = configurations(factors)
    capture_ops = capture_ops and request.rollout is None
    record = {
        **request.record("ablate"),
        "factors": list(factors),
        "capture_ops": capture_ops,
        "status": "running",
        "configurations": [
            {"name": c.name, "factor": c.factor, "kind": c.kind, "strict": format_strict(c.strict)} for c in rows_of
        ],
    }
    write_json(out / RUN, record)
    rows = []
    for i, config in enumerate(rows_of):
        if on_stage:
            on_stage(f"configuration {i + 1}/{len(rows_of)}: {config.kind} {config.factor}")
        sub = with_strict(request, config.strict)
        directory = out / CONFIGS / config.name
        directory.mkdir(parents=True, exist_ok=True)
        # the row's own marker, made during this run (so ablate's record lists it): a later gate or report of the row
        # records what it writes there, and ablate --force judges those files by it (capture/written.py)
        outdir.claim(directory, tuple(sorted({*COMPARE_OUTPUTS, *BISECT_OUTPUTS, *DIFF_OUTPUTS, RUN})))
        first = None
        if capture_ops:
            result = bisect(sub, directory, Selection(), mode="natural")
            first = result["natural"]["first_divergence"]
            summary = diff_captures(
                read_capture(directory / "train"),
                read_capture(directory / "infer"),
                directory,
                clip_eps=request.clip_eps,
            )
        else:
            summary = compare(sub, directory)
        rows.append(
            {
                "factor": config.factor,
                "kind": config.kind,
                "strict": format_strict(config.strict) or "none",
                "mismatches": summary["mismatches"],
                "tokens": summary["tokens_compared"],
                "max_ulp": summary["ulp_max"],
                "max_abs_diff": summary["max_abs_diff"],
                "first_diverging_op": first["op"] if first else None,
                "directory": str(directory.relative_to(out)),
            }
        )
    matrix = pd.DataFrame(rows)
    matrix.to_parquet(out / ABLATE_PARQUET, index=False)
    write_json(
        out / ABLATE_JSON,
        {
            "model": request.spec.name,
            "mode": request.mode,
            "capture_ops": capture_ops,
            "train": request.train.label(),
            "infer": request.infer.label(),
            "notes": _notes(request, capture_ops),
            "rows": rows,
        },
    )
    write_json(out / RUN, seal(record, out, (ABLATE_PARQUET, ABLATE_JSON, CONFIGS)))
    return matrix
