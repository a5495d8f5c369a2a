"""Rollouts an RL framework recorded, read from a file for ``alignaudit rescore`` (docs/cli.md "rescore").

One row per rollout, JSON lines or parquet, the same columns either way:
    token_ids       list of int: the prompt's tokens, then the sampled ones
    prompt_length   int >= 1: how many of token_ids are the prompt (at least one token must follow)
    logprobs        list of float: the rollout engine's logprob of each sampled token (len(token_ids) -
                    prompt_length values, in order), as it recorded them while sampling
    temperature, top_k, top_p, logprobs_mode   optional, the same in every row: how the engine sampled, and
                    whether its logprobs are "raw" (vLLM's default) or "processed" (after the sampling
                    transform; the trainer then replays it)
The format is told by the content (parquet's PAR1 magic, torch.save's zip: slime, else UTF-8 JSON lines, NeMo-RL's
by their keys), not the name; the frameworks' dumps: alignaudit.inputs.framework_dumps. Refused with one
line naming the row and the fix: a file of another format (gzip, torch.save / pickle, UTF-16), a missing column,
lengths that disagree, a NaN, infinite, beyond-fp32 or positive logprob (a file of values all >= 0 is named as
negative log-likelihoods), token ids outside the vocabulary, settings that differ between rows or are no valid
value (temperature >= 0, > 0 for processed logprobs; top_k an integer >= -1, -1 read as vLLM's "disabled" = 0;
top_p in (0, 1]), and verl's rollout_data_dir dumps
(JSON lines of decoded text, "input" and "output", and scores, written by RayPPOTrainer._dump_generations in
verl/trainer/ppo/ray_trainer.py: no token ids and no rollout logprobs, so nothing to rescore).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from alignaudit.errors import InputError
from alignaudit.inputs.framework_dumps import NEMO_RL_KEYS, is_nemo_rl, nemo_rl_rows, slime_rows
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import REPLAYED
from alignaudit.inputs.values import check_logprob_signs, parse_json

COLUMNS = ("token_ids", "prompt_length", "logprobs")
SAMPLING = ("temperature", "top_k", "top_p", "logprobs_mode")
LOGPROBS_MODES = ("raw", "processed")


@dataclass
class Rollouts:
    """A checked rollout file.

    Attributes:
        batch: every rollout's token ids (prompt then sampled tokens). prompt_lengths: per rollout.
        logprobs: per rollout, fp32 [number of sampled tokens], the rollout engine's values.
        sampling: the optional settings (SAMPLING keys present in the file or given), one value each;
            logprobs_mode always ("raw" where neither says: vLLM's default, and then ``assumed``).
        source: {"path", "sha256", "format"} of the file.
        assumed: the sampling keys neither the file nor the command line gave (recorded as such in run.json).
    """

    batch: TokenBatch
    prompt_lengths: list[int]
    logprobs: list[torch.Tensor]
    sampling: dict
    source: dict
    assumed: tuple[str, ...] = ()

    @property
    def processed(self) -> bool:
        """Whether the engine recorded processed logprobs (the trainer must replay temperature, top-k, top-p)."""
        return self.sampling.get("logprobs_mode") == "processed"


def read_rollouts(
    path: Path | str, vocab_size: int, given: dict | None = None, max_positions: int | None = None
) -> Rollouts:
    """Read and check a rollout file (the module docstring's schema); ``vocab_size``: the model's. ``given``: SAMPLING
    settings from the command line (rescore --temperature ...), for files that do not record them; one the file
    records with another value is refused. ``max_positions``: the model's max_position_embeddings; a rollout longer
    is refused (the engines would rotate its tail at positions the model never saw, or refuse it late).

    Raises:
        InputError: an unreadable or damaged file (one line naming the row, the column and the fix).
    """
    path = Path(path)
    if not path.is_file():
        if path.exists() and not path.is_dir():  # a pipe (<(...)), a socket, a device: it exists, and is no file
            raise InputError(
                f"{path} is not a regular file (a pipe or a device, such as <(...) gives): rescore reads "
                "the file more than once (its format, its rows, its digest); write it to a file first"
            )
        what = "a directory" if path.is_dir() else "no such file"
        raise InputError(f"{path}: {what}; give a JSONL or parquet file of rollouts")
    rows, fmt, where = _read_rows(path)
    if not rows:
        raise InputError(f"{path} holds no rollouts")
    if {"input", "output"} <= set(rows[0]) and "token_ids" not in rows[0]:
        raise InputError(
            f"{path} looks like a verl rollout_data_dir dump (decoded text, no token ids or rollout "
            "logprobs); write token_ids, prompt_length and logprobs per rollout (docs/cli.md 'rescore')"
        )
    sequences, lengths, logprobs = [], [], []
    for i, row in enumerate(rows):
        missing = [c for c in COLUMNS if row.get(c) is None]
        if missing:
            raise InputError(
                f"{path}: {where[i]} has no {', '.join(missing)}; every rollout needs {', '.join(COLUMNS)}"
            )
        ids, n, lps = _ids(path, where[i], row["token_ids"], vocab_size), row["prompt_length"], row["logprobs"]
        if max_positions is not None and len(ids) > max_positions:
            raise InputError(
                f"{path}: {where[i]} has {len(ids)} token_ids, more than the model's {max_positions} "
                "positions (max_position_embeddings); rescore it with the model that generated it"
            )
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < len(ids):
            raise InputError(
                f"{path}: {where[i]}: prompt_length {n!r} must be an integer in [1, {len(ids) - 1}] "
                "(the prompt's tokens, with at least one sampled token after them)"
            )
        values = _floats(path, where[i], lps)
        if len(values) != len(ids) - n:
            raise InputError(
                f"{path}: {where[i]} has {len(values)} logprobs for {len(ids) - n} sampled tokens "
                f"({len(ids)} token_ids, prompt_length {n}); give one logprob per sampled token"
            )
        bad = [j for j, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise InputError(
                f"{path}: {where[i]}: logprob {bad[0]} is {values[bad[0]]}; a rollout engine's logprob "
                "of a token it sampled is finite: the file is damaged"
            )
        beyond = [j for j, v in enumerate(values) if abs(v) > FP32_MAX]
        if beyond:
            raise InputError(
                f"{path}: {where[i]}: logprob {beyond[0]} is {values[beyond[0]]}, outside fp32's "
                "range (engines record fp32 logprobs): the file is damaged"
            )
        sequences.append(tuple(ids))
        lengths.append(n)
        logprobs.append(torch.tensor(values, dtype=torch.float32))
    check_logprob_signs(str(path), logprobs, where)
    if all(not bool(lp.any()) for lp in logprobs):
        raise InputError(
            f"{path}: every logprob is exactly 0.0: placeholders, not a rollout engine's logprobs (a "
            "framework writes 0 where the engine returned none: verl without calculate_log_probs, NeMo-RL "
            "without generation logprobs); record them and dump again"
        )
    sampling = _sampling(path, rows, given or {})
    assumed = () if "logprobs_mode" in sampling else ("logprobs_mode",)
    sampling.setdefault("logprobs_mode", "raw")  # vLLM's default, named in ``assumed``
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Rollouts(
        TokenBatch(tuple(sequences), source=f"rollouts:{path.name}"),
        lengths,
        logprobs,
        sampling,
        {"path": str(path.resolve()), "sha256": digest, "format": fmt},
        assumed,
    )


FORMATS = (
    "rescore reads JSON lines (UTF-8 text, one rollout object per line) or parquet, with token_ids, "
    "prompt_length and logprobs per rollout, NeMo-RL's train_data_step*.jsonl and slime's "
    "--save-debug-rollout-data .pt files (docs/cli.md 'rescore')"
)
FP32_MAX = float(torch.finfo(torch.float32).max)


def _read_rows(path: Path) -> tuple[list[dict], str, list[str]]:
    """The file's rows, its format ("parquet", "jsonl", "nemo-rl" or "slime"), told by its content, not its name,
    and where each row sits, as errors name it: "line N" of a text file (1-based, as editors count; blank lines
    skipped), "row N" of a parquet table and "sample N" of slime's list (0-based, as pandas and Python index).

    Raises:
        InputError: a file of another format (gzip, a torch.save or pickle file, UTF-16 or other non-UTF-8
            text), naming what it is and the formats rescore reads.
    """
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        rows = _parquet_rows(path)
        return rows, "parquet", [f"row {i}" for i in range(len(rows))]
    if path.suffix == ".parquet":
        raise InputError(f"{path} is not a parquet file (no PAR1 magic); {FORMATS}")
    if head[:2] == b"PK":  # a zip archive: torch.save's format, as slime writes its debug rollout files
        rows = slime_rows(path)
        return rows, "slime", [f"sample {i}" for i in range(len(rows))]
    what = _binary_kind(head)
    if what:
        raise InputError(f"{path} is {what}; {FORMATS}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{path} is not UTF-8 text (byte {e.start} is {path.read_bytes()[e.start]:#04x}); {FORMATS}"
        ) from None
    rows, where = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{path}:{number}")
        except InputError as e:
            raise InputError(f"{e}; {FORMATS}") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number} is not a JSON object; one rollout object per line")
        rows.append(row)
        where.append(f"line {number}")
    if rows and is_nemo_rl(rows[0]):
        return nemo_rl_rows(path, rows, where), "nemo-rl", where
    if rows and {"input_lengths", "token_loss_mask"} <= set(rows[0]):  # NeMo-RL's, without a key it needs
        missing = [key for key in NEMO_RL_KEYS if key not in rows[0]]
        raise InputError(
            f"{path}:1 looks like NeMo-RL's train_data_step (input_lengths, token_loss_mask) but has no "
            f"{', '.join(missing)}; rescore reads NeMo-RL's lines with {', '.join(NEMO_RL_KEYS)}"
        )
    return rows, "jsonl", where


def _binary_kind(head: bytes) -> str | None:
    """What a file whose first bytes are ``head`` is, where it is a binary format rescore does not read."""
    if head[:2] == b"\x1f\x8b":
        return "gzip-compressed (decompress it first)"
    if head[:1] == b"\x80":
        return (
            "a pickle (torch.save's legacy format, or verl's RolloutSkip dump of a DataProto, whose unpickling "
            "needs verl, tensordict and ray; write its prompts, responses and rollout_log_probs as JSON lines)"
        )
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "UTF-16 text (write it as UTF-8)"
    return None


def _parquet_rows(path: Path) -> list[dict]:
    import pandas as pd

    try:
        table = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for damaged files
        raise InputError(f"{path} is not a readable parquet file ({type(e).__name__}); write it again") from e
    return [{k: _plain(v) for k, v in row.items()} for row in table.to_dict("records")]


def _plain(value):
    """Parquet cells as JSON would give them: lists and Python scalars (NaN of a missing cell as None)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _ids(path: Path, where: str, ids, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputError(f"{path}: {where}: token_ids must be a list of integers")
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise InputError(
            f"{path}: {where}: token id {outside[0]} is outside the model's vocabulary of {vocab_size}; "
            "rescore with the model the rollouts were sampled from"
        )
    return ids


def _floats(path: Path, where: str, values) -> list[float]:
    if not isinstance(values, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values if v is not None
    ):
        raise InputError(f"{path}: {where}: logprobs must be a list of numbers")
    return [float("nan") if v is None else float(v) for v in values]


def _sampling(path: Path, rows: list[dict], given: dict) -> dict:
    """The SAMPLING settings the file gives, the same in every row, with ``given`` for those it does not."""
    found = {}
    for key in SAMPLING:
        values = {json.dumps(row.get(key)) for row in rows}
        if len(values) > 1:
            raise InputError(
                f"{path}: {key} differs between rollouts ({', '.join(sorted(values))}); rescore each "
                "setting's rollouts from a file of their own"
            )
        value = rows[0].get(key)
        if value is not None:
            found[key] = value
        if given.get(key) is not None:
            if value is not None and value != given[key]:
                raise InputError(
                    f"{path} records {key} {value!r}, and --{key.replace('_', '-')} {given[key]!r} was "
                    "given; drop the option (the file says how its rollouts were sampled)"
                )
            found[key] = given[key]
    if found.get("logprobs_mode", "raw") not in LOGPROBS_MODES:
        raise InputError(f"{path}: logprobs_mode {found['logprobs_mode']!r}: choose raw or processed")
    missing = [k for k in REPLAYED if k not in found]
    processed = found.get("logprobs_mode") == "processed"
    unused = [f"--{k.replace('_', '-')}" for k in REPLAYED if given.get(k) is not None]
    if unused and not processed:
        raise InputError(
            f"{' '.join(unused)} given for raw logprobs: only processed logprobs are scored under the "
            "sampling transform, so it would change nothing; drop it, or give --logprobs-mode processed "
            "if the engine recorded processed logprobs"
        )
    if processed and missing:
        raise InputError(
            f"{path}: the logprobs are processed but the file gives no {', '.join(missing)}; the trainer "
            "must replay the sampling transform they were processed with"
        )
    _check_setting(
        path,
        found,
        "temperature",
        lambda v: _number(v) and (v > 0 if processed else v >= 0),
        "a number > 0 (processed logprobs at temperature 0 are vLLM's greedy path, its raw logprobs: "
        "write logprobs_mode raw)"
        if processed
        else "a number >= 0",
    )
    _check_setting(
        path,
        found,
        "top_k",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1,
        "an integer: 0 or -1 (vLLM's 'disabled') or k >= 1",
    )
    _check_setting(path, found, "top_p", lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]")
    if found.get("top_k") == -1:
        found["top_k"] = 0  # vLLM's "disabled" (SamplingParams.top_k -1), the replay's 0
    return found


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_setting(path: Path, found: dict, key: str, valid, expected: str) -> None:
    if key in found and not valid(found[key]):
        raise InputError(f"{path}: {key} {found[key]!r}: {expected}")
