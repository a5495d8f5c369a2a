"""Worker process entry: run one engine on one request and write a capture directory.

    python -m alignaudit.workers.capture_worker REQUEST.json [--out NEW_DIR]   (alignaudit.workers.job.CaptureJob's
        record: a capture directory's request.json runs again, into NEW_DIR; a directory holding a capture is refused)
    python -m alignaudit.workers.capture_worker --check-options '[{"engine", "settings", "spec", "role", "mode"}, ...]'
        (validate only)

Every engine runs in a worker of its own (vLLM's in-process engine patches torch; Megatron keeps global
parallel state). A library error is reported on stderr as one line starting with ``ERROR_MARKER`` followed
by JSON, so the parent can re-raise it with the same type and exit code. Megatron at tensor-parallel size
t > 1 runs as t rank processes started here (torch.multiprocessing, one rendezvous file); every rank runs
the request, rank 0 alone reports progress and writes the capture.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.workers.job import CaptureJob, OpsRequest

ERROR_MARKER = "ALIGNAUDIT-WORKER-ERROR "
PROGRESS_MARKER = "ALIGNAUDIT-PROGRESS "


def report_progress(done: int, total: int) -> None:
    """One progress line on stdout (sequences done of total); the parent shows it and keeps it out of the log."""
    print(f"{PROGRESS_MARKER}{done} {total}", flush=True)


def run_job(job: CaptureJob) -> None:
    """Run the job on this process, or on its tensor-parallel ranks."""
    tp = ranks_to_spawn(job.engine, job.settings)
    if tp > 1:
        run_ranks(job, tp)
    else:
        run_rank(job, 0)


def ranks_to_spawn(engine: str, settings: EngineSettings) -> int:
    """How many rank processes a worker starts for ``engine``: its tensor-parallel size where alignaudit starts
    the engine's ranks (Megatron), else 1 (vLLM starts its own; HF has none)."""
    from alignaudit.engines import kind_of

    kind = kind_of(engine)
    return int(kind.tensor_parallel_size(settings)) if kind.spawns_ranks else 1


def rank_start_method(settings: EngineSettings) -> str:
    """How a worker starts its rank processes: "spawn" (a fresh interpreter) on CUDA, where a forked child cannot
    use a CUDA context; "fork" on the CPU, where the worker has only imported (no engine, no thread pool yet),
    so each rank skips importing torch and Megatron-Core again (about 6 s per rank on 2 cores)."""
    return "spawn" if settings.device == "cuda" else "fork"


def start_ranks(target, payload, settings: EngineSettings, tp: int, nprocs: int, join: bool):
    """Start ``nprocs`` processes running ``target(index, payload, tp)`` that meet in one process group (a fresh
    rendezvous file in RENDEZVOUS_ENV), by ``rank_start_method(settings)``; torch.multiprocessing.start_processes'
    result (its ProcessExitedException when joined and a rank failed). ``payload`` is pickled to each rank."""
    import os

    import torch.multiprocessing as mp

    from alignaudit.engines.megatron.adapter import RENDEZVOUS_ENV, rendezvous_file

    os.environ[RENDEZVOUS_ENV] = rendezvous_file()
    sys.stdout.flush()  # a forked rank would write out a copy of anything still buffered
    sys.stderr.flush()
    return mp.start_processes(
        target, args=(payload, tp), nprocs=nprocs, join=join, start_method=rank_start_method(settings)
    )


def run_ranks(job: CaptureJob, tp: int) -> None:
    """Start ``tp`` rank processes and wait for all; a rank's failure ends the worker with that rank's exit
    code (the rank reported its error on the shared stderr)."""
    import torch.multiprocessing as mp

    try:
        start_ranks(_rank_main, job, job.settings, tp, nprocs=tp, join=True)
    except mp.ProcessExitedException as e:
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 3)


def _rank_main(rank: int, job: CaptureJob, tp: int) -> None:
    import os

    from alignaudit.engines.megatron.adapter import RANK_ENV, WORLD_ENV

    os.environ[RANK_ENV], os.environ[WORLD_ENV] = str(rank), str(tp)
    _guarded(lambda: run_rank(job, rank))


def run_rank(job: CaptureJob, rank: int) -> None:
    from alignaudit.capture.directory import SCORED_GENERATED, logprob_table, write_capture
    from alignaudit.capture.environment import hardware, numerics_flags, package_versions
    from alignaudit.engines import load_engine_class

    spec, settings, batch, out, sampling = job.spec, job.settings, job.batch, job.out, job.rollout
    started = time.perf_counter()
    engine = load_engine_class(job.engine)(spec, settings)
    if rank == 0:
        engine.progress = report_progress
    loaded = time.perf_counter()
    tap = _attach_tap(engine, spec, job.ops, out, rank)
    if job.routing_from:  # compare --replay-routing: the rollout engine's experts, before any forward
        engine.replay_routing(replayed_routing(job.routing_from, spec, batch), [len(s) for s in batch.sequences])
    engine.replay = job.replay
    prompt_lengths = list(engine.replay.prompt_lengths) if engine.replay else None
    rows = None
    if job.full_vocab:  # prompt mode only (engines.checks.check_full_vocab refuses the rest)
        from alignaudit.capture.vocab_rows import VocabRowWriter

        rows = VocabRowWriter(out, [len(s) for s in batch.sequences], engine.vocab_row_formula()) if rank == 0 else None
        engine.vocab_sink = rows.write if rows is not None else (lambda seq, r: None)
    if sampling is not None:
        prompt_lengths = [len(s) for s in batch.sequences for _ in range(sampling.group_size)]
        batch, logprobs = engine.rollout(batch, sampling)
    else:
        logprobs = engine.prompt_logprobs(batch)
    engine.vocab_sink = None  # rows of the first run only (--repeat runs again without them)
    repeats = None
    if job.repeat > 1:  # compare --repeat: the same engine again, op capture done
        from alignaudit.workers.repeats import run_repeats

        if engine.hooks is not None:
            engine.hooks.close()
        engine.hooks = engine.tap = None
        repeats = run_repeats(engine, batch, logprobs, job.repeat, settings.seed)
    finished = time.perf_counter()
    manifest = {
        "engine": job.engine,
        "role": job.role,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {**spec.to_dict(), "checkpoint_sha256": job.checkpoint_sha256},
        "settings": settings.to_dict(),
        "engine_settings": engine.settings_record(),
        "mode": "rollout" if sampling is not None else "prompt",
        "rollout": {**sampling.to_dict(), "prompt_lengths": prompt_lengths} if sampling is not None else None,
        "replay": engine.replay.to_dict() if engine.replay else None,
        "routing_from": str(job.routing_from) if job.routing_from else None,
        "prompts": {
            "source": batch.source,
            "num_sequences": len(batch.sequences),
            "num_tokens": batch.num_tokens,
            "digest": batch.digest(),
            "texts": list(batch.texts),
        },
        "versions": package_versions(),
        "hardware": hardware(settings.device),
        "numerics": numerics_flags(),
        "timing_s": {"load": round(loaded - started, 3), "forward": round(finished - loaded, 3)},
    }
    if repeats is not None:
        manifest["repeats"] = repeats
    if rows is not None:
        manifest["vocab"] = rows.finish()
    if rank != 0:
        engine.close()
        return
    if tap is not None and job.ops is not None:  # a tap exists only for job.ops
        unforced = tap.unforced_ops()
        manifest["ops"] = {
            **tap.recorder.finish(),
            "unforced_ops": unforced,
            "selection": job.ops.selection.to_dict(),
            "mode": "forced" if tap.reference is not None else "natural",
            "reference": str(job.ops.reference) if job.ops.reference else None,
            "substituted_ops": len(tap.substituted),
        }
    engine.close()
    table = logprob_table(batch, logprobs, prompt_lengths)
    if sampling is not None and not sampling.prompt_logprobs:  # the sampled tokens' logprobs only
        table["scored"] = table["generated"]
        manifest["scored"] = SCORED_GENERATED
    write_capture(out, manifest, table)


def replayed_routing(path: Path, spec, batch) -> dict:
    """The routing a capture recorded (its ``routing`` ops), as layer -> sequence -> int64 [tokens, top_k], for
    Engine.replay_routing. Raises InputError when the capture holds no routing of every layer or was made on
    other token ids."""
    from alignaudit.capture.directory import read_capture
    from alignaudit.capture.op_store import OpStore
    from alignaudit.capture.ops import op_id
    from alignaudit.errors import InputError

    source = read_capture(path)
    if source.manifest["prompts"]["digest"] != batch.digest():
        raise InputError(f"routing replay: {path} was captured on other token ids than this run's")
    store = OpStore(path, source.manifest.get("ops"))
    routing = {layer: store.sequences(op_id("routing", layer)) for layer in range(spec.num_layers)}
    if not all(routing.values()):
        raise InputError(f"routing replay: {path} holds no routing of every layer; capture it with the routing op")
    return routing


def _attach_tap(engine, spec, ops: OpsRequest | None, out: Path, rank: int = 0):
    """Natural capture of the selected ops, or forced mode when a reference capture is given. Every
    tensor-parallel rank taps (gathering a sharded op is collective); rank 0 alone records."""
    if ops is None:
        return None
    from alignaudit.capture.op_store import OpRecorder, OpStore
    from alignaudit.engines.taps import Tap

    reference = None
    if ops.reference is not None:
        from alignaudit.capture.directory import read_capture

        reference = OpStore(ops.reference, read_capture(ops.reference).manifest.get("ops"))
    recorder = OpRecorder(out) if rank == 0 else None
    tap = Tap(spec, ops.selection, recorder, reference, record_all=rank != 0)
    engine.attach(tap)
    return tap


USAGE = "python -m alignaudit.workers.capture_worker REQUEST.json [--out NEW_DIR]"


def main() -> None:
    def work():
        args = sys.argv[1:]
        if args[:1] == ["--check-options"] and len(args) == 2:
            check_options(json.loads(args[1]))
        elif len(args) in (1, 3) and (len(args) == 1 or args[1] == "--out"):
            run_job(job_to_run(Path(args[0]), Path(args[2]) if len(args) == 3 else None))
        else:
            from alignaudit.errors import InputError

            raise InputError(f"usage: {USAGE}")

    _guarded(work)


def job_to_run(request: Path, out: Path | None) -> CaptureJob:
    """The job in ``request`` (a capture's request.json), written to ``out`` when given: how a capture is reproduced.
    The parent (alignaudit.workers.spawn.run_capture) clears the capture directory's manifest before it starts a
    worker, so a directory that holds one is a finished capture, which a reproduction must not overwrite.

    Raises:
        InputError: the job cannot be read (CaptureJob.read), or its directory holds a capture already.
    """
    import dataclasses

    from alignaudit.capture.rundir import MANIFEST
    from alignaudit.errors import InputError
    from alignaudit.workers.job import CaptureJob

    job = CaptureJob.read(request)
    if out is not None:
        job = dataclasses.replace(job, out=out.resolve())
    if (job.out / MANIFEST).exists():
        raise InputError(
            f"{job.out} holds a capture already ({MANIFEST}); to run the job again without overwriting "
            f"it, name a new directory: {USAGE}"
        )
    job.out.mkdir(parents=True, exist_ok=True)
    return job


def check_options(checks: list[dict]) -> None:
    from alignaudit.engines import load_engine_class
    from alignaudit.inputs.checkpoint import ModelSpec
    from alignaudit.inputs.request import EngineSettings

    for check in checks:
        cls = load_engine_class(check["engine"])
        settings = EngineSettings(**check["settings"])
        cls.check_options(settings.options)
        cls.check_config(ModelSpec(**check["spec"]), settings, check["role"], check["mode"])


def _guarded(work) -> None:
    """Run ``work``; a library error becomes an ERROR_MARKER line and its exit code, anything else exit 3."""
    from alignaudit.errors import EXIT_ENGINE, AlignAuditError

    try:
        work()
    except AlignAuditError as e:
        traceback.print_exc()
        record = {"type": type(e).__name__, "message": str(e)}
        print(ERROR_MARKER + json.dumps(record), file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(EXIT_ENGINE)


if __name__ == "__main__":
    main()
