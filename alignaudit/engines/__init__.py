"""Engines, looked up by name: each engine's kind (alignaudit.engines.kind.EngineKind), light, consulted before
any engine starts; its adapter module imports the engine itself, in a worker."""

from __future__ import annotations

from alignaudit.engines.hf import KIND as HF
from alignaudit.engines.kind import EngineKind
from alignaudit.engines.megatron import KIND as MEGATRON
from alignaudit.engines.vllm import KIND as VLLM
from alignaudit.errors import InputError

KINDS: dict[str, EngineKind] = {kind.name: kind for kind in (HF, MEGATRON, VLLM)}


def kind_of(name: str) -> EngineKind:
    """Raises InputError for an unknown engine name."""
    try:
        return KINDS[name]
    except KeyError:
        raise InputError(f"unknown engine {name!r}; choose one of {', '.join(KINDS)}") from None


def names_where(capable) -> str:
    """The engines whose kind ``capable(kind)`` holds for, as a message lists them: "hf or megatron"."""
    return " or ".join(kind.name for kind in KINDS.values() if capable(kind))


def check_installed(name: str) -> None:
    """Raise EngineError with the install command when the engine's package is missing."""
    kind_of(name).check_installed()


def load_engine_class(name: str):
    """The adapter class of engine ``name`` (imports the engine)."""
    return kind_of(name).adapter_class()
