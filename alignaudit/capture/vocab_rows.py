"""Full-vocabulary rows of a capture (``compare --full-vocab``): each scored position's whole log-softmax row.

Layout, inside a capture directory:
    vocab/seq-00000.safetensors ...   one file per sequence, one tensor "logprobs": float32 [len - 1, V]; row
                                      t holds log p(v | s[:t + 1]) for every vocabulary entry v, computed as the
                                      engine computes its token logprobs (the manifest's ``vocab.rows`` says
                                      how), so row t's entry at s[t + 1] is the capture's logprob at position
                                      t + 1 wherever the engine's own logprob is that formula's gather
The manifest records (``VocabRowWriter.finish``) the vocabulary size, the formula and the sha256 of every
file; ``check_listing`` makes read_capture refuse a listing that is not one file per sequence, and
``read_rows`` checks a file's sha256, tensor name, dtype and shape before returning it, so damaged or
swapped rows are an error, never a divergence. Non-finite values are the engine's, kept as they came
(alignaudit.comparison.vocab counts them apart).

Files are written as the engine produces each sequence's rows, so a capture holds at most one sequence's rows
beyond what the engine itself holds. Size: 4 x V bytes per scored position (Qwen3's 151,936 entries: 594 KiB).
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignaudit.capture.digest import file_sha256
from alignaudit.capture.rundir import VOCAB_DIR, VOCAB_ROWS
from alignaudit.errors import InputError

TENSOR = "logprobs"


class VocabRowWriter:
    """Receives each sequence's rows (``write(seq, rows)``) and writes them to ``DIR/vocab/``."""

    def __init__(self, capture_dir: Path, lengths: list[int], rows: str):
        """``lengths``: each sequence's token count (rows expected: length - 1); ``rows``: how the engine computed
        them, in words, for the manifest."""
        self.directory = Path(capture_dir) / VOCAB_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lengths, self.rows = lengths, rows
        self.files: dict[str, str] = {}
        self.vocab_size: int | None = None

    def write(self, seq: int, rows: torch.Tensor) -> None:
        """Store sequence ``seq``'s rows: float32 [len - 1, V] (a copy on the host). Raises ValueError for a wrong
        dtype or shape, a sequence written twice or a vocabulary size that changes (a wiring bug, never data)."""
        from safetensors.torch import save_file

        name = VOCAB_ROWS.format(seq=seq)
        expected = self.lengths[seq] - 1
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[0] != expected:
            raise ValueError(
                f"vocab rows of sequence {seq}: {rows.dtype}{tuple(rows.shape)}, expected float32 [{expected}, V]"
            )
        if name in self.files or (self.vocab_size is not None and rows.shape[1] != self.vocab_size):
            raise ValueError(f"vocab rows of sequence {seq}: written twice or of another vocabulary size")
        self.vocab_size = rows.shape[1]
        path = self.directory / name
        save_file({TENSOR: rows.detach().to("cpu", copy=True).contiguous()}, str(path))
        self.files[name] = file_sha256(path)

    def finish(self) -> dict:
        """The manifest's ``vocab`` record. Raises ValueError when a sequence got no rows."""
        missing = [s for s in range(len(self.lengths)) if VOCAB_ROWS.format(seq=s) not in self.files]
        if missing:
            raise ValueError(f"vocab rows: sequences {missing[:5]} got none (the engine's row hook missed them)")
        return {
            "rows": self.rows,
            "dtype": "float32",
            "vocab_size": self.vocab_size,
            "files": dict(sorted(self.files.items())),
        }


def check_listing(directory: Path, record: dict, lengths: list[int]) -> None:
    """The manifest's ``vocab`` record lists one file per sequence with a sha256, and each exists.

    Raises:
        InputError: naming what is missing or malformed.
    """
    files = record.get("files") if isinstance(record, dict) else None
    expected = {VOCAB_ROWS.format(seq=s) for s in range(len(lengths))}
    if (
        not isinstance(files, dict)
        or set(files) != expected
        or not all(isinstance(v, str) for v in files.values())
        or not isinstance(record.get("vocab_size"), int)
    ):
        raise InputError(
            f"{directory}: the manifest's vocab record does not list one row file per sequence with its "
            "sha256; the capture is damaged, run it again"
        )
    absent = sorted(n for n in expected if not (Path(directory) / VOCAB_DIR / n).is_file())
    if absent:
        raise InputError(f"{Path(directory) / VOCAB_DIR / absent[0]} is missing; the capture is damaged, run it again")


def read_rows(directory: Path, record: dict, seq: int, length: int) -> torch.Tensor:
    """Sequence ``seq``'s rows, float32 [length - 1, vocab_size], checked against the manifest's ``vocab``
    record (sha256 of the file, tensor name, dtype, shape).

    Raises:
        InputError: the file is missing, changed, or holds another tensor.
    """
    name = VOCAB_ROWS.format(seq=seq)
    path = Path(directory) / VOCAB_DIR / name
    if not path.is_file() or file_sha256(path) != (record.get("files") or {}).get(name):
        raise InputError(
            f"{path} is missing or does not match the manifest's sha256; the capture is damaged, run it again"
        )
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    rows = tensors.get(TENSOR)
    shape = (length - 1, record.get("vocab_size"))
    if rows is None or set(tensors) != {TENSOR} or rows.dtype != torch.float32 or tuple(rows.shape) != shape:
        raise InputError(f"{path} does not hold float32 rows of shape {list(shape)}; the capture is damaged")
    return rows


def read_step_rows(path: Path, tokens: int, vocab_size: int) -> torch.Tensor:
    """``rl --full-vocab``: one side's rows of a step's generated tokens, float32 [tokens, vocab_size], from the file
    its worker wrote (capture.rundir.STEP_VOCAB_ROWS: one tensor STEP_VOCAB_TENSOR, row i scoring the step's
    token-table row i).

    Raises:
        EngineError: the file is missing or holds another tensor, dtype or shape (the worker's rows do not cover
            the step's tokens: a wiring bug, never a divergence).
    """
    from safetensors.torch import load_file

    from alignaudit.capture.rundir import STEP_VOCAB_TENSOR
    from alignaudit.errors import EngineError

    path = Path(path)
    tensors = load_file(str(path)) if path.is_file() else {}
    rows = tensors.get(STEP_VOCAB_TENSOR)
    if (
        rows is None
        or set(tensors) != {STEP_VOCAB_TENSOR}
        or rows.dtype != torch.float32
        or tuple(rows.shape) != (tokens, vocab_size)
    ):
        got = f"{rows.dtype}{list(rows.shape)}" if rows is not None else "nothing"
        raise EngineError(
            f"{path}: full-vocabulary rows {got}, expected float32 [{tokens}, {vocab_size}] (one per "
            "generated token of the step)"
        )
    return rows
