"""Shared fixtures: the tiny Qwen3 checkpoint and real engine captures, built once per test session.

Engine captures are expensive on 2 CPU cores (a worker process per engine, 10-40 s each), so each
(engine, dtype, options) capture is made once and shared by every test that needs it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from alignaudit.capture.directory import read_capture
from alignaudit.capture.rundir import CAPTURE_OUTPUTS
from alignaudit.inputs.checkpoint import load_spec
from alignaudit.inputs.prompts import load_prompts
from helpers import FIXTURE, CaptureCache

# vLLM 0.32 (CPU wheel) with torch 2.13 cannot load its own AOT-compiled artifacts ("'function' object has no
# attribute 'finalize_loading'", vllm/compilation/decorators.py) and compiles every engine again; its older
# compile cache loads. Measured on 2 cores: a warm start's vLLM init 14.2 s -> 5.9 s, test_cli + test_engines
# 575 s -> 504 s from empty caches (2026-12-01, AMD EPYC, AVX2). Tests compare engines within one run;
# every manifest records the variable (environment.numerics_flags).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="run the slow tests: real-shape models, every kernel launch configuration (minutes each)",
    )
    parser.addoption(
        "--kernel-device",
        default="cpu",
        choices=("cpu", "cuda", "interpret"),
        help="strict-kernel backend for tests/kernels/ (interpret: set TRITON_INTERPRET=1)",
    )


def pytest_collection_modifyitems(config, items):
    # Files marked `long` first, in collection order: run by `make test` (--dist loadfile --no-loadscope-reorder),
    # the two workers start them first and end on short files, together. xdist's own order (most tests first) left
    # the interpreter's 2 tests (110 s) for last, on one worker while the other sat idle (2026-12-04, 2 cores).
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow (minutes): run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Synthesized checkpoints and digests go to a per-session cache, never the user's."""
    os.environ.setdefault("ALIGNAUDIT_CACHE", str(tmp_path_factory.mktemp("alignaudit-cache")))


@pytest.fixture(scope="session", autouse=True)
def _preloaded_workers(_isolated_cache):
    """Capture workers launched in-process (spawn.start_worker: captures and option checks) and the RL loop's session
    workers (spawn.start_session) are forked from a server
    per engine that has imported it once (alignaudit.workers.preloaded): each capture still builds and runs its
    engine in a process of its own, without its 5-10 s of imports on 2 cores. A launch under another environment
    (a test's monkeypatch.setenv) gets a server of its own; commands run as subprocesses (run_cli) fork nothing."""
    from alignaudit.workers import preloaded, spawn

    fresh, fresh_session = spawn.start_worker, spawn.start_session
    pool = preloaded.Preloaded(fresh, fresh_session=fresh_session)
    spawn.start_worker, spawn.start_session = pool.start_worker, pool.start_session
    yield
    spawn.start_worker, spawn.start_session = fresh, fresh_session
    pool.close()


# Engine settings that reach a worker through its environment rather than its request (fault injection, kernels,
# vLLM and torch switches): part of what a capture is, so part of its key (where caches live is not).
CAPTURE_ENV_PREFIXES = ("ALIGNAUDIT_", "VLLM_", "TRITON_", "TORCH", "OMP_", "CUDA_", "MKL_")


@pytest.fixture(scope="session", autouse=True)
def _captures_once_per_session(tmp_path_factory):
    """Every engine capture a test asks for in-process (pipelines.runs.capture: the CLI's compare, bisect, ablate, gate
    and the CaptureCache) runs the real engine once per test session and request; the same request again, from
    any test or test process, gets a copy of that real capture. The key is the whole worker job but its directory
    (CaptureJob: engine, settings, checkpoint sha256, token ids, role, ops, rollout, replay, repeat) and the
    worker's environment variables that change what it computes. Not memoized: forced-mode op capture (its
    reference is a path), routing replay (its routing source is a path), captures that stream their log, and
    failures. Commands run as subprocesses (run_cli) always run engines."""
    from alignaudit.pipelines import runs as pipeline

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one directory for every xdist worker of the session
    store = shared / "capture-memo"
    store.mkdir(exist_ok=True)
    real = pipeline.run_capture

    def run_capture(job, **kw):
        if kw.get("stream_log") or (job.ops is not None and job.ops.reference) or job.routing_from:
            return real(job, **kw)
        keyed = {k: v for k, v in job.to_dict().items() if k != "out"}
        env = {k: v for k, v in os.environ.items() if k.startswith(CAPTURE_ENV_PREFIXES) and "CACHE" not in k}
        key = hashlib.sha256(json.dumps([keyed, env], sort_keys=True, default=str).encode()).hexdigest()[:24]
        kept, out = store / key, job.out
        with open(store / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (kept / ".complete").exists():
                result = real(job, **kw)
                _copy_capture(out, kept)
                (kept / ".complete").touch()
                return result
        _copy_capture(kept, out)
        return read_capture(out)

    pipeline.run_capture = run_capture
    yield
    pipeline.run_capture = real


def _copy_capture(src: Path, dst: Path) -> None:
    """The files a capture worker writes (rundir.CAPTURE_OUTPUTS), from ``src`` into ``dst`` (replacing the
    ones there, as a new capture does), with new modification times, as a capture written now has (the output
    directory's record takes only files modified since the command's claim: capture/written.py)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in CAPTURE_OUTPUTS:
        if (dst / name).is_dir():
            shutil.rmtree(dst / name)
        elif (dst / name).exists():
            (dst / name).unlink()
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name, copy_function=shutil.copy)
        elif (src / name).exists():
            shutil.copy(src / name, dst / name)


@pytest.fixture(scope="session")
def tiny_spec():
    return load_spec(FIXTURE)


@pytest.fixture(scope="session")
def tiny_batch(tiny_spec):
    return load_prompts(tiny_spec)


@pytest.fixture(scope="session")
def captures(tmp_path_factory, tiny_spec, tiny_batch):
    return CaptureCache(tmp_path_factory.mktemp("captures"), tiny_spec, tiny_batch)
