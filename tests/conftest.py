"""Shared fixtures: the tiny Qwen3 checkpoint and real engine captures, built once per test session.

Engine captures are expensive on 2 CPU cores (a worker process per engine, 10-40 s each), so each
(engine, dtype, options) capture is made once and shared by every test that needs it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from alignaudit.capture.ops import Selection
from alignaudit.commands.pipeline import EngineRun, capture
from alignaudit.inputs.checkpoint import load_spec
from alignaudit.inputs.prompts import load_prompts
from alignaudit.inputs.request import EngineSettings

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "qwen3-tiny"

# vLLM 0.32 (CPU wheel) with torch 2.13 cannot load its own AOT-compiled artifacts ("'function' object has no
# attribute 'finalize_loading'", vllm/compilation/decorators.py) and compiles every engine again; its older
# compile cache loads. Measured on 2 cores: a warm start's vLLM init 14.2 s -> 5.9 s, test_cli + test_engines
# 575 s -> 504 s from empty caches (2026-12-01, AMD EPYC, AVX2). Tests compare engines within one run;
# every manifest records the variable (environment.numerics_flags).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="run the slow tests: real-shape models, every kernel launch configuration (minutes each)")
    parser.addoption("--kernel-device", default="cpu", choices=("cpu", "cuda", "interpret"),
                     help="strict-kernel backend for tests/test_kernels.py (interpret: set TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture(scope="session")
def tiny_spec():
    return load_spec(FIXTURE)


@pytest.fixture(scope="session")
def tiny_batch(tiny_spec):
    return load_prompts(tiny_spec)


class CaptureCache:
    """Real engine captures of the fixture on the built-in prompts, keyed by (engine, dtype, options)."""

    def __init__(self, root: Path, spec, batch):
        self.root, self.spec, self.batch = root, spec, batch
        self.done = {}

    def get(self, engine: str, dtype: str, ops: bool | Selection = False, reference=None, strict: str = "",
            rollout=None, batch=None, **options):
        """A capture; ``ops`` adds every canonical op (or those of a Selection); ``reference`` (a capture) runs
        forced mode; ``strict`` swaps in strict kernels; ``rollout`` samples; ``batch`` (a capture) scores its
        tokens."""
        selection = ops if isinstance(ops, Selection) else Selection() if ops or reference else None
        key = (engine, dtype, json.dumps(selection.to_dict(), sort_keys=True) if isinstance(ops, Selection) else ops,
               reference.path.name if reference else None, strict or None,
               json.dumps(rollout, sort_keys=True) if rollout else None, batch.path.name if batch else None,
               json.dumps(options, sort_keys=True))
        if key not in self.done:
            name = "-".join(str(k) for k in key if k not in (None, False, "{}")).replace("/", "_").replace(" ", "")
            run = EngineRun(engine, EngineSettings(dtype=dtype, device="cpu", options=options, strict=strict))
            tokens = batch.token_batch() if batch is not None else self.batch
            self.done[key] = capture(self.spec, tokens, run, self.root / name,
                                     ops=selection,
                                     reference=reference.path if reference else None, rollout=rollout)
        return self.done[key]


@pytest.fixture(scope="session")
def captures(tmp_path_factory, tiny_spec, tiny_batch):
    return CaptureCache(tmp_path_factory.mktemp("captures"), tiny_spec, tiny_batch)


def assert_bitwise_equal(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Assert identical bit patterns; on failure report count, max ULP, max |diff| and first indices."""
    from alignaudit.comparison import numerics

    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    same = numerics.bitwise_equal(a, b)
    if bool(same.all()):
        return
    ulp = numerics.ulp_distance(a, b)
    where = (~same).nonzero()[:5].tolist()
    raise AssertionError(
        f"{name}: {int((~same).sum())} of {same.numel()} elements differ; max ULP {int(ulp.max())}, "
        f"max |diff| {float((a.double() - b.double()).abs().max()):.3e}; first at {where}"
    )
