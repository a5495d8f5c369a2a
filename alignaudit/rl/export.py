"""Export of the rl per-step series to TensorBoard and to W&B (offline), through their own libraries.

`alignaudit rl --log-to tensorboard,wandb`: every numeric column of a steps.parquet row (booleans as 0/1; the
weights digest and absent values left out) is logged at that step under ``alignaudit/<column>``:
    tensorboard   torch.utils.tensorboard.SummaryWriter into RUN/tensorboard/ (event files; TensorBoard stores
                  scalars as float32); flushed after every step, so a crashed run's steps are there
    wandb         wandb.init(mode="offline") into RUN/wandb/ (``wandb sync RUN/wandb/offline-run-*`` uploads it
                  later); run.json's settings as the run config
A missing library is refused before any engine starts (``check_sinks``), with the pip command that fixes it.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import TYPE_CHECKING

from alignaudit.capture.rundir import TENSORBOARD_DIR
from alignaudit.errors import InputError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from wandb import Run

SINKS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # sink -> the pip package it needs
PREFIX = "alignaudit/"


def parse_sinks(value: str | None) -> tuple[str, ...]:
    """``--log-to`` as sink names, in order, each once; () for None or "". Raises InputError for an unknown name or
    a sink whose library is not installed (naming the pip command)."""
    if not value:
        return ()
    names = [n.strip() for n in value.split(",") if n.strip()]
    return check_sinks(tuple(dict.fromkeys(names)))


def check_sinks(names: tuple[str, ...]) -> tuple[str, ...]:
    """Returns ``names``; raises InputError for a name not in SINKS or whose library is not importable."""
    for name in names:
        if name not in SINKS:
            raise InputError(f"--log-to {name}: not an export; choose from {', '.join(SINKS)} (comma-separated)")
        try:
            importlib.import_module(SINKS[name])
        except ImportError:
            raise InputError(
                f"--log-to {name}: the {SINKS[name]} package is not installed; run "
                f"`pip install {SINKS[name]}` (or drop {name} from --log-to)"
            ) from None
    return names


def scalars(row: dict) -> dict[str, float]:
    """The loggable numbers of a step row: numeric and boolean columns, finite, under PREFIX; ``step`` is the
    x axis, not a series."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, str) or value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[PREFIX + key] = number
    return out


class StepExport:
    """The open sinks of one rl run: ``log(row)`` after every step, ``close()`` at the end (idempotent)."""

    def __init__(self, names: tuple[str, ...], out: Path, config: dict):
        self.tensorboard: SummaryWriter | None = None
        self.wandb: Run | None = None
        try:
            if "tensorboard" in names:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR))
            if "wandb" in names:
                import wandb

                self.wandb = wandb.init(  # writes RUN/wandb/offline-run-*
                    mode="offline",
                    dir=str(out),
                    project="alignaudit",
                    name=out.name,
                    config=config,
                    settings=wandb.Settings(console="off", silent=True),
                )
        except BaseException:
            self.close()
            raise

    def log(self, row: dict) -> None:
        values, step = scalars(row), int(row["step"])
        if self.tensorboard is not None:
            for tag, value in values.items():
                self.tensorboard.add_scalar(tag, value, global_step=step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        tensorboard, run = self.tensorboard, self.wandb
        self.tensorboard = self.wandb = None
        if tensorboard is not None:
            tensorboard.close()
        if run is not None:
            run.finish()
