"""Per-op tensors of a capture: streamed to disk while the engine runs, read back per op.

Layout, inside a capture directory:
    ops/chunk-00000.safetensors ...   canonical tensors, key "{op}|{seq}|{pos_start}", rows = tokens
    ops/index.parquet                 op, layer, name, seq, pos_start, pos_end, dtype, shape, file, key
    ops/fingerprints.parquet          op, seq, tokens, sha256 of the sequence's bytes in position order
The capture's manifest records (OpRecorder.finish) the sha256 of the index and of the fingerprints and the
ops recorded, in order; OpStore checks both files and that the index holds exactly those ops, so an op
removed from (or added to) the index is an error, never a first divergence that silently moved.

Tensors go to host memory as the hook fires and to disk every ``flush_bytes`` (256 MiB by default), so a
capture never holds more than that much beyond what the engine itself holds. Two captures whose
fingerprints of an (op, seq) agree hold bitwise identical tensors there; every read checks the
fingerprint, so a damaged chunk is an error, never a difference.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch

from alignaudit.capture.digest import file_sha256
from alignaudit.capture.ops import split_op_id
from alignaudit.capture.rundir import FINGERPRINTS, INDEX, OPS_DIR
from alignaudit.errors import InputError

if TYPE_CHECKING:
    from safetensors import safe_open


class OpRecorder:
    """Receives canonical chunks (``op``, ``seq``, ``pos_start``, rows tensor) and streams them to disk."""

    def __init__(self, capture_dir: Path, flush_bytes: int = 256 << 20):
        self.directory = Path(capture_dir) / OPS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.flush_bytes = flush_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_rows: list[dict] = []
        self.pending_bytes = 0
        self.rows: list[dict] = []
        self.hashes: dict[tuple[str, int], list] = {}  # (op, seq) -> [sha256, next expected pos]
        self.chunks = 0
        self.total_bytes = 0

    def record(self, op: str, seq: int, pos_start: int, tensor: torch.Tensor) -> None:
        """Store rows ``pos_start .. pos_start + len(tensor)`` of ``op`` for sequence ``seq`` (a copy)."""
        t = tensor.detach().to("cpu", copy=True).contiguous()
        state = self.hashes.setdefault((op, seq), [hashlib.sha256(), 0])
        if pos_start != state[1]:
            raise RuntimeError(f"{op} seq {seq}: chunk at position {pos_start}, expected {state[1]} (hook mapping bug)")
        state[0].update(t.view(torch.uint8).numpy())
        state[1] = pos_start + t.shape[0]
        key = f"{op}|{seq}|{pos_start}"
        name, layer = split_op_id(op)
        self.pending[key] = t
        self.pending_rows.append(
            {
                "op": op,
                "layer": -1 if layer is None else layer,
                "name": name,
                "seq": seq,
                "pos_start": pos_start,
                "pos_end": pos_start + t.shape[0],
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "key": key,
            }
        )
        self.pending_bytes += t.nbytes
        if self.pending_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = f"chunk-{self.chunks:05d}.safetensors"
        save_file(self.pending, str(self.directory / file))
        for row in self.pending_rows:
            row["file"] = file
        self.rows += self.pending_rows
        self.chunks += 1
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_rows, self.pending_bytes = {}, [], 0

    def finish(self) -> dict:
        """Write the index and fingerprints; return a summary for the manifest (what OpStore checks)."""
        self.flush()
        pd.DataFrame(
            self.rows, columns=["op", "layer", "name", "seq", "pos_start", "pos_end", "dtype", "shape", "key", "file"]
        ).to_parquet(self.directory / INDEX, index=False)
        prints = [
            {"op": op, "seq": seq, "tokens": state[1], "sha256": state[0].hexdigest()}
            for (op, seq), state in self.hashes.items()
        ]
        pd.DataFrame(prints, columns=["op", "seq", "tokens", "sha256"]).to_parquet(
            self.directory / FINGERPRINTS, index=False
        )
        op_ids = list(dict.fromkeys(r["op"] for r in self.rows))
        return {
            "ops": len(op_ids),
            "bytes": self.total_bytes,
            "files": self.chunks,
            "op_ids": op_ids,
            "index_sha256": file_sha256(self.directory / INDEX),
            "fingerprints_sha256": file_sha256(self.directory / FINGERPRINTS),
        }


class OpStore:
    """Read side: per-op, per-sequence canonical tensors of one capture.

    ``recorded``: the manifest's ``ops`` record (OpRecorder.finish), against which the index and the
    fingerprints are checked.

    Raises:
        InputError: the capture has no ops (made without op capture); its index or fingerprints are not the
            files the capture wrote, or the index lacks an op it recorded (named) or holds one it did not; a
            chunk file is unreadable.
    """

    def __init__(self, capture_dir: Path, recorded: dict | None, cache_ops: int = 32):
        self.directory = Path(capture_dir) / OPS_DIR
        if not (self.directory / INDEX).is_file():
            raise InputError(
                f"{capture_dir} has no per-op tensors; make it with `alignaudit capture` (ops are on by default)"
            )
        recorded = recorded or {}
        for name, key in ((INDEX, "index_sha256"), (FINGERPRINTS, "fingerprints_sha256")):
            if not recorded.get(key):
                raise InputError(
                    f"{capture_dir}'s manifest records no sha256 of {OPS_DIR}/{name} (made by an older "
                    "alignaudit?); capture again"
                )
            if not (self.directory / name).is_file() or file_sha256(self.directory / name) != recorded[key]:
                raise InputError(
                    f"{self.directory / name} is missing or is not the file the capture wrote (its sha256 "
                    "differs from the manifest's); capture again"
                )
        try:
            self.index = pd.read_parquet(self.directory / INDEX)
            self.fingerprints = (
                pd.read_parquet(self.directory / FINGERPRINTS).set_index(["op", "seq"])["sha256"].to_dict()
            )
        except Exception as e:  # pyarrow raises several types for missing/truncated files
            raise InputError(
                f"{self.directory} has a missing or corrupt index ({type(e).__name__}); capture again"
            ) from e
        held, expected = self.op_ids(), list(recorded.get("op_ids") or [])
        if held != expected:
            gone = [op for op in expected if op not in held]
            raise InputError(
                f"{self.directory / INDEX}: "
                + (f"op {gone[0]} is missing" if gone else "holds ops the capture did not record")
                + " (the manifest lists what was captured); "
                "capture again"
            )
        self._handles: dict[str, safe_open] = {}
        self._cache: OrderedDict[str, dict[int, torch.Tensor]] = OrderedDict()
        self._cache_ops = cache_ops

    def op_ids(self) -> list[str]:
        return list(dict.fromkeys(self.index["op"]))

    def has(self, op: str) -> bool:
        return op in self._op_groups()

    def fingerprint(self, op: str, seq: int) -> str | None:
        return self.fingerprints.get((op, seq))

    def sequences(self, op: str) -> dict[int, torch.Tensor]:
        """``{seq: tensor [tokens, ...]}`` for one op (rows concatenated in position order)."""
        if op in self._cache:
            self._cache.move_to_end(op)
            return self._cache[op]
        rows = self._op_groups().get(op)
        if rows is None:
            return {}
        result = {}
        for seq, chunk in rows.sort_values(["seq", "pos_start"]).groupby("seq"):
            t = torch.cat([self._load(r.file, r.key) for r in chunk.itertuples()], dim=0)
            digest = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().data).hexdigest()
            if digest != self.fingerprint(op, int(seq)):
                raise InputError(
                    f"{self.directory}: {op} of sequence {seq} does not match its sha256 fingerprint; "
                    "the capture is corrupt, capture again"
                )
            result[int(seq)] = t
        self._cache[op] = result
        if len(self._cache) > self._cache_ops:
            self._cache.popitem(last=False)
        return result

    def rows(self, op: str, seq: int, pos_start: int, length: int) -> torch.Tensor | None:
        """Rows ``pos_start .. pos_start + length`` of one sequence, or None if not captured."""
        t = self.sequences(op).get(seq)
        if t is None or t.shape[0] < pos_start + length:
            return None
        return t[pos_start : pos_start + length]

    def _op_groups(self) -> dict[str, pd.DataFrame]:
        if not hasattr(self, "_groups"):
            self._groups = dict(tuple(self.index.groupby("op", sort=False)))
        return self._groups

    def _load(self, file: str, key: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            if file not in self._handles:
                self._handles[file] = safe_open(str(self.directory / file), framework="pt")
            return self._handles[file].get_tensor(key)
        except Exception as e:  # safetensors raises several types for truncated files
            raise InputError(f"{self.directory / file} is missing or corrupt ({e}); capture again") from e
