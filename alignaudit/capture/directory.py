"""The capture directory: what one engine run leaves on disk, and its reader.

Layout (format version 2):
    DIR/manifest.json      engine, model (spec + checkpoint digest), dtype, settings as they reached the
                           engine, package versions, hardware, numerics flags, prompts digest, status
    DIR/logprobs.parquet   one row per token: seq (int32), pos (int32), token_id (int32), scored (bool:
                           the position has a logprob; False exactly at pos 0), logprob (float32; NaN and
                           Inf are the engine's values, kept as they came; NaN filler where not scored),
                           generated (bool: sampled by this engine in rollout mode, its logprob recorded
                           while decoding)
    DIR/vocab/             with ``compare --full-vocab`` only: every scored position's full log-softmax row, one
                           file per sequence (alignaudit.capture.vocab_rows; the manifest's ``vocab`` record)

A capture of a rollout file (``alignaudit rescore``: engine "rollout-file") holds the rollout engine's logprobs of
the sampled tokens only: its manifest says ``"scored": "generated"``, and ``scored`` is true exactly where
``generated`` is; a comparison with it covers the sampled tokens.

The manifest is written last, atomically, with ``"status": "complete"`` and the sha256 of
logprobs.parquet: a directory without it is an interrupted capture, one whose table does not match it (or
whose manifest lacks the checksum) is damaged, and every reader refuses both. Version 1 stored position 0
as a null, which pandas also makes of NaN, so an engine's NaN logprobs vanished; version 2 keeps the two
apart with ``scored``.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from alignaudit.capture.digest import file_sha256
from alignaudit.capture.rundir import LOGPROBS, MANIFEST, MANIFEST_TMP, RUN
from alignaudit.errors import InputError
from alignaudit.inputs.prompts import TokenBatch

FORMAT = "alignaudit-capture"
VERSION = 2
SCORED_GENERATED = "generated"  # manifest "scored": a rollout file's capture, logprobs of sampled tokens only


def logprob_table(
    batch: TokenBatch, logprobs: list[torch.Tensor], prompt_lengths: list[int] | None = None
) -> pd.DataFrame:
    """Per-token rows from the batch and each sequence's fp32 logprobs (shape [len - 1]); positions at
    or past ``prompt_lengths[i]`` are marked generated. NaN and Inf logprobs are stored as they are."""
    import numpy as np

    frames = []
    for seq_index, (ids, lp) in enumerate(zip(batch.sequences, logprobs, strict=True)):
        if lp.shape != (len(ids) - 1,):
            raise ValueError(f"sequence {seq_index}: expected {len(ids) - 1} logprobs, got {tuple(lp.shape)}")
        values = np.concatenate([[np.nan], lp.to(torch.float32).numpy()]).astype(np.float32)
        frames.append(
            pd.DataFrame(
                {
                    "seq": np.full(len(ids), seq_index, dtype=np.int32),
                    "pos": np.arange(len(ids), dtype=np.int32),
                    "token_id": np.asarray(ids, dtype=np.int32),
                    "scored": np.arange(len(ids)) > 0,
                    "logprob": values,
                    "generated": np.arange(len(ids)) >= (prompt_lengths[seq_index] if prompt_lengths else len(ids)),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def rollout_file_table(batch: TokenBatch, prompt_lengths: list[int], logprobs: list[torch.Tensor]) -> pd.DataFrame:
    """The logprob table of a rollout file's capture: ``logprobs[i]`` (fp32 [len - prompt_lengths[i]]) at the
    sampled positions, scored and generated there only (NaN filler elsewhere)."""
    full = [torch.cat([torch.full((n - 1,), float("nan")), lp]) for n, lp in zip(prompt_lengths, logprobs, strict=True)]
    table = logprob_table(batch, full, prompt_lengths)
    table["scored"] = table["generated"]
    return table


def write_capture(directory: Path, manifest: dict, logprobs: pd.DataFrame) -> None:
    """Write the parquet table, then the manifest (atomically, marked complete), with a ``capture_id`` of its own (a
    random UUID: a copy of the directory keeps it, a second capture never has it; comparison.integrity.load_pair)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    logprobs.to_parquet(directory / LOGPROBS, index=False)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "capture_id": uuid.uuid4().hex,
        **manifest,
        "files": {LOGPROBS: file_sha256(directory / LOGPROBS)},
        "status": "complete",
    }
    tmp = directory / MANIFEST_TMP
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, directory / MANIFEST)


@dataclass
class Capture:
    """A capture directory, read and checked."""

    path: Path
    manifest: dict
    logprobs: pd.DataFrame

    @property
    def engine(self) -> str:
        return self.manifest.get("engine", "?")

    def logprob_sequences(self) -> dict[int, torch.Tensor]:
        """``{seq: float32 tensor [len - 1]}``: the logprobs as a canonical op (position 0 has none)."""
        table = self.logprobs.sort_values(["seq", "pos"])
        table = table[table["scored"]]
        return {
            int(seq): torch.from_numpy(g["logprob"].to_numpy(dtype="float32").copy()) for seq, g in table.groupby("seq")
        }

    @property
    def has_vocab_rows(self) -> bool:
        """Whether the capture holds full-vocabulary rows (``compare --full-vocab``)."""
        return bool(self.manifest.get("vocab"))

    def vocab_rows(self, seq: int) -> torch.Tensor:
        """Sequence ``seq``'s full log-softmax rows, float32 [len - 1, V], checked (alignaudit.capture.vocab_rows.
        read_rows). Raises InputError when the capture holds none or the file is damaged."""
        from alignaudit.capture.vocab_rows import read_rows

        if not self.has_vocab_rows:
            raise InputError(f"{self.path} holds no full-vocabulary rows; capture it with --full-vocab")
        length = int((self.logprobs["seq"] == seq).sum())
        return read_rows(self.path, self.manifest["vocab"], seq, length)

    def token_batch(self) -> TokenBatch:
        """The token ids this capture was made on, rebuilt from the table."""
        groups = self.logprobs.sort_values(["seq", "pos"]).groupby("seq")["token_id"]
        return TokenBatch(tuple(tuple(int(t) for t in ids) for _, ids in groups))


def read_capture(directory: Path) -> Capture:
    """Load and validate a capture directory.

    Raises:
        InputError: missing, unreadable, incomplete or inconsistent capture (the message says which).
    """
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if directory.is_file():
        raise InputError(f"{directory} is a file, not a capture directory")
    if not directory.is_dir():
        raise InputError(f"{directory} is not a capture directory (it does not exist)")
    if not manifest_path.is_file():
        if (directory / RUN).is_file():
            raise InputError(
                f"{directory} is a compare/bisect run; its captures are {directory}/train and {directory}/infer"
            )
        raise InputError(f"{directory} has no {MANIFEST}: the capture is incomplete or was interrupted; run it again")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 text
        raise InputError(f"{manifest_path} is corrupt ({e}); run the capture again") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("status") != "complete":
        raise InputError(f"{manifest_path} is not a complete {FORMAT} manifest; run the capture again")
    if manifest.get("version") != VERSION:
        raise InputError(
            f"{directory} has capture format version {manifest.get('version')}; this alignaudit reads {VERSION}"
        )
    expected = (manifest.get("files") or {}).get(LOGPROBS)
    if not isinstance(expected, str):
        raise InputError(f"{manifest_path} records no sha256 of {LOGPROBS}; the capture is damaged, run it again")
    if not (directory / LOGPROBS).is_file() or file_sha256(directory / LOGPROBS) != expected:
        raise InputError(
            f"{directory / LOGPROBS} is missing or does not match the manifest's sha256; the capture "
            "is damaged, run it again"
        )
    try:
        table = pd.read_parquet(directory / LOGPROBS)
    except Exception as e:  # pyarrow raises several types for missing/truncated files
        raise InputError(
            f"{directory / LOGPROBS} is missing or corrupt ({type(e).__name__}); run the capture again"
        ) from e
    _check_table(directory, manifest, table)
    if manifest.get("vocab"):
        from alignaudit.capture.vocab_rows import check_listing

        check_listing(
            directory, manifest["vocab"], [len(s) for s in Capture(directory, manifest, table).token_batch().sequences]
        )
    return Capture(directory, manifest, table)


COLUMNS = {
    "seq": "int32",
    "pos": "int32",
    "token_id": "int32",
    "scored": "bool",
    "logprob": "float32",
    "generated": "bool",
}


def _check_table(directory: Path, manifest: dict, table: pd.DataFrame) -> None:
    """Columns and dtypes, counts and token digest against the manifest, positions 0..n-1 per sequence
    in order, ``scored`` exactly where pos > 0."""
    import numpy as np

    wrong = [
        f"{c} ({table[c].dtype if c in table else 'missing'})"
        for c, t in COLUMNS.items()
        if c not in table or str(table[c].dtype) != t
    ]
    if wrong:
        raise InputError(f"{directory / LOGPROBS}: wrong or missing columns {', '.join(wrong)}; the capture is damaged")
    prompts = manifest.get("prompts", {})
    n_seq = table["seq"].nunique()
    if n_seq != prompts.get("num_sequences") or len(table) != prompts.get("num_tokens"):
        raise InputError(
            f"{directory}: table holds {n_seq} sequences / {len(table)} tokens but the manifest says "
            f"{prompts.get('num_sequences')} / {prompts.get('num_tokens')}; the capture is damaged, run it again"
        )
    seq, pos = table["seq"].to_numpy(), table["pos"].to_numpy()
    starts = np.r_[True, seq[1:] != seq[:-1]]
    expected_pos = np.arange(len(table)) - np.maximum.accumulate(np.where(starts, np.arange(len(table)), 0))
    if len(table) and (not np.array_equal(pos, expected_pos) or not np.array_equal(seq[starts], np.arange(n_seq))):
        raise InputError(
            f"{directory / LOGPROBS}: rows are not sequences 0..{n_seq - 1} with positions 0..n-1 in "
            "order (rows dropped, duplicated or reordered); the capture is damaged, run it again"
        )
    generated_only = manifest.get("scored") == SCORED_GENERATED
    expected = table["generated"].to_numpy(dtype=bool) if generated_only else pos > 0
    if not np.array_equal(table["scored"].to_numpy(), expected):
        where = "the sampled tokens" if generated_only else "every position but 0"
        raise InputError(f"{directory / LOGPROBS}: 'scored' must be true exactly at {where}; the capture is damaged")
    rebuilt = Capture(directory, manifest, table).token_batch()
    if rebuilt.digest() != prompts.get("digest"):
        raise InputError(f"{directory}: token ids do not match the manifest's digest; the capture is damaged")
