"""What the parent asks of a worker process, as typed records written to a JSON file the worker reads back:

- CaptureJob: one capture worker's run, ``request.json`` in the capture directory (kept there so that a run can be
  reproduced with ``python -m alignaudit.workers.capture_worker request.json``), read by the worker and by each
  tensor-parallel rank it starts (pickled by torch.multiprocessing);
- SessionJob: one long-lived RL worker's engine (and, for the trainer, its optimizer), ``train.request.json`` or
  ``infer.request.json`` in the rl run directory, read by ``python -m alignaudit.workers.rl_session``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from alignaudit.capture.ops import Selection
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import DTYPES, EngineSettings, Replay, Sampling
from alignaudit.inputs.values import parse_json


@dataclass(frozen=True)
class OpsRequest:
    """Per-op capture: which ops (``selection``), and for forced mode the capture whose op inputs the engine is fed
    (``reference``: an absolute path, None in natural mode)."""

    selection: Selection
    reference: Path | None = None

    def to_dict(self) -> dict:
        return {
            "selection": self.selection.to_dict(),
            "reference": str(self.reference) if self.reference is not None else None,
        }

    @classmethod
    def from_dict(cls, record: dict | None) -> OpsRequest | None:
        if record is None:
            return None
        reference = record.get("reference")
        return cls(Selection.from_dict(record.get("selection")), Path(reference) if reference else None)


@dataclass(frozen=True)
class CaptureJob:
    """One engine run on one batch, as a worker process carries it out (alignaudit.workers.capture_worker).

    Attributes:
        engine: the engine's name (alignaudit.engines.ENGINES).
        spec: the model; settings: the engine's settings (dtype, device, options, strict ops and kernels).
        batch: the token ids scored, or prompted in rollout mode.
        out: the capture directory (absolute).
        role: "train" or "infer" inside a compare, None for a capture of its own.
        checkpoint_sha256: the checkpoint's digest (alignaudit.inputs.checkpoint.checkpoint_sha256), recorded.
        ops: per-op capture (None: logprobs only).
        rollout: sample completions under these settings (None: prompt mode, teacher-forced scoring).
        replay: score generated tokens under the rollout's sampling transform (a trainer replaying processed logprobs).
        routing_from: a capture holding every MoE layer's ``routing`` op, replayed by the engine's router.
        repeat: > 1 (prompt mode): the engine runs again on the same token ids, also among fillers.
        full_vocab: (prompt mode) every scored position's full log-softmax row is written too.
    """

    engine: str
    spec: ModelSpec
    settings: EngineSettings
    batch: TokenBatch
    out: Path
    role: str | None = None
    checkpoint_sha256: str | None = None
    ops: OpsRequest | None = None
    rollout: Sampling | None = None
    replay: Replay | None = None
    routing_from: Path | None = None
    repeat: int = 1
    full_vocab: bool = False

    def to_dict(self) -> dict:
        return {
            "engine": self.engine,
            "role": self.role,
            "spec": self.spec.to_dict(),
            "settings": self.settings.to_dict(),
            "batch": self.batch.to_dict(),
            "checkpoint_sha256": self.checkpoint_sha256,
            "ops": self.ops.to_dict() if self.ops is not None else None,
            "rollout": self.rollout.to_dict() if self.rollout is not None else None,
            "replay": self.replay.to_dict() if self.replay is not None else None,
            "routing_from": str(self.routing_from) if self.routing_from is not None else None,
            "repeat": self.repeat,
            "full_vocab": self.full_vocab,
            "out": str(self.out),
        }

    @classmethod
    def from_dict(cls, record: dict) -> CaptureJob:
        """``to_dict()``'s record back. Raises KeyError or TypeError for a record another version wrote."""
        rollout, routing_from = record.get("rollout"), record.get("routing_from")
        return cls(
            engine=record["engine"],
            spec=ModelSpec(**record["spec"]),
            settings=EngineSettings(**record["settings"]),
            batch=TokenBatch.from_dict(record["batch"]),
            out=Path(record["out"]),
            role=record.get("role"),
            checkpoint_sha256=record.get("checkpoint_sha256"),
            ops=OpsRequest.from_dict(record.get("ops")),
            rollout=Sampling(**rollout) if rollout else None,
            replay=Replay.from_dict(record.get("replay")),
            routing_from=Path(routing_from) if routing_from else None,
            repeat=record.get("repeat", 1),
            full_vocab=record.get("full_vocab", False),
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> CaptureJob:
        """The job a ``request.json`` holds (``write``'s file, or one edited by hand to reproduce a capture).

        Raises:
            InputError: no such file, not JSON, or not a job this alignaudit wrote (a key missing, a value of
                another type, a field unknown), naming the file and the field.
        """
        path = Path(path)
        record = _load(path, "a capture job")
        try:
            _check_fields(record, ("engine", "spec", "settings", "batch", "out"))
            _check_engine_fields(record)
            job = cls.from_dict(record)
        except InputError as e:
            raise InputError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"{path}: not a capture job this alignaudit can read ({type(e).__name__}: {e})") from None
        if not isinstance(job.repeat, int) or isinstance(job.repeat, bool) or job.repeat < 1:
            raise InputError(f"{path}: repeat {job.repeat!r}: a whole number >= 1")
        return job


ROLES = ("trainer", "rollout")  # an RL session worker's roles


@dataclass(frozen=True)
class SessionJob:
    """One RL session worker (alignaudit.workers.rl_session): the engine it holds, and a trainer's optimizer settings.

    Attributes:
        role: "trainer" (the engine trains: forward, backward, optimizer step, weight export) or "rollout" (the
            engine samples and loads the trainer's weights).
        engine: the engine's name (alignaudit.engines.ENGINES). spec: the model. settings: the engine's settings.
        lr: the optimizer's learning rate; clip_grad: the gradient-norm clip (0: none); offload_fraction: the share
            of the optimizer state kept on the host (rl.memory), in [0, 1]; kl_coef: the GRPO loss's KL weight (the
            trainer's only; alignaudit.training.trainer.Trainer).
    """

    role: str
    engine: str
    spec: ModelSpec
    settings: EngineSettings
    lr: float = 0.0
    clip_grad: float = 0.0
    offload_fraction: float = 0.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InputError(f"role {self.role!r}: one of {', '.join(ROLES)}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise InputError(f"offload_fraction {self.offload_fraction!r}: a fraction in [0, 1]")

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "engine": self.engine,
            "spec": self.spec.to_dict(),
            "settings": self.settings.to_dict(),
            "lr": self.lr,
            "clip_grad": self.clip_grad,
            "offload_fraction": self.offload_fraction,
            "kl_coef": self.kl_coef,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> SessionJob:
        """The job ``write`` put in ``path``.

        Raises:
            InputError: no such file, not JSON, or not a session job (a key missing, a field unknown, a value of
                another type or out of range), naming the file and the field.
        """
        path = Path(path)
        record = _load(path, "a session job")
        try:
            _check_fields(record, (), cls)
            _check_engine_fields(record)
            return cls(
                **(record | {"spec": ModelSpec(**record["spec"]), "settings": EngineSettings(**record["settings"])})
            )
        except InputError as e:
            raise InputError(f"{path}: {e}") from None
        except (TypeError, ValueError) as e:
            raise InputError(f"{path}: not a session job this alignaudit can read ({type(e).__name__}: {e})") from None


def _load(path: Path, what: str) -> dict:
    """The JSON object a job file holds. Raises InputError: unreadable, not JSON (alignaudit.inputs.values), or a
    value other than an object (``what`` names the job in the message)."""
    try:
        record = parse_json(path.read_bytes(), str(path))
    except OSError as e:
        raise InputError(f"{path}: cannot read the job ({e.strerror})") from None
    if not isinstance(record, dict):
        raise InputError(f"{path}: {what} is a JSON object, not {type(record).__name__}")
    return record


def _check_engine_fields(record: dict) -> None:
    """InputError unless a job's ``spec`` and ``settings`` are ModelSpec's and EngineSettings' fields, of their
    types, with a dtype alignaudit runs (inputs.request.DTYPES)."""
    _check_fields(record["spec"], (), ModelSpec, "spec")
    _check_fields(record["settings"], (), EngineSettings, "settings")
    if record["settings"].get("dtype") not in DTYPES:
        raise InputError(f"settings.dtype {record['settings'].get('dtype')!r}: one of {', '.join(DTYPES)}")


# the annotations of ModelSpec's and EngineSettings' scalar fields, as written (from __future__ import annotations)
_SCALARS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_fields(record, required: tuple[str, ...], cls=None, where: str = "") -> None:
    """InputError unless ``record`` is an object holding ``required`` and, for a dataclass ``cls``, only its fields,
    its required fields, and scalar fields of their annotated type (a bool is no int)."""
    prefix = f"{where}." if where else ""
    if not isinstance(record, dict):
        raise InputError(f"{where or 'the job'}: a JSON object, not {type(record).__name__}")
    missing = [key for key in required if key not in record]
    if cls is not None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - set(fields))
        if unknown:
            raise InputError(f"{prefix}{unknown[0]}: not a field of {cls.__name__}")
        missing += [
            name
            for name, f in fields.items()
            if name not in record and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        for name, value in record.items():
            kinds = _SCALARS.get(str(fields[name].type))
            if kinds and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
                raise InputError(f"{prefix}{name} {value!r}: a {fields[name].type}")
    if missing:
        raise InputError(f"{prefix}{missing[0]}: missing")
