"""Seeded random-weight checkpoints in the Hugging Face layout (config.json + safetensors shards).

Each tensor is drawn from its own generator, seeded from (seed, tensor name), so the bytes do not depend
on shard layout or generation order. Scales keep activations O(1) through the network and logits at a
standard deviation of about 3 (a peaked but not degenerate next-token distribution):
    embeddings, lm_head      N(0, (3/sqrt(hidden))^2)
    linear weights           N(0, 1/fan_in)
    RMSNorm weights          1 + N(0, 0.1^2)   (not all ones, so a mis-mapped norm weight shows)
    biases                   N(0, 0.1^2)
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch

_DONE = ".alignaudit-complete"


def random_tensor(name: str, shape: tuple[int, ...], kind: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """One weight tensor, reproducible from (seed, name) alone."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if kind == "norm":
        x = 1.0 + 0.1 * x
    elif kind == "bias":
        x *= 0.1
    elif kind == "embed":
        x *= 3.0 / math.sqrt(shape[1])
    else:
        x *= 1.0 / math.sqrt(shape[1])
    return x.to(dtype)


def synthesize_checkpoint(config: dict, target: Path, seed: int = 0, shard_bytes: int = 4 << 30) -> Path:
    """Write config.json and random bf16 safetensors for ``config`` into ``target`` (once).

    A finished checkpoint is marked by a sentinel file holding the config and seed; a second call with the
    same arguments returns at once. The checkpoint is built in a sibling temp dir and renamed into place,
    so an interrupted run never leaves a half-written checkpoint behind.
    """
    target = Path(target)
    stamp = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    done = target / _DONE
    if done.is_file() and done.read_text() == stamp:
        return target
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    writer = _ShardWriter(tmp, shard_bytes)
    from alignaudit.arch import architecture

    for name, shape, kind in architecture(config["architectures"][0]).weight_shapes(config):
        writer.add(name, random_tensor(name, shape, kind, seed, dtype))
    writer.finish()
    (tmp / _DONE).write_text(stamp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


class _ShardWriter:
    """Writes tensors into safetensors shards of at most ``limit`` bytes, as they come."""

    def __init__(self, directory: Path, limit: int):
        self.directory, self.limit = directory, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.written: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending and self.size + tensor.nbytes > self.limit:
            self._flush()
        self.pending[name] = tensor
        self.size += tensor.nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            save_file(self.pending, str(self._shard(len(self.written))), metadata={"format": "pt"})
            self.written.append(list(self.pending))
        self.pending, self.size = {}, 0

    def _shard(self, i: int) -> Path:
        return self.directory / f"shard-{i:05d}.safetensors"

    def finish(self) -> None:
        """Flush, then name the files as Hugging Face does (one file, or shards plus an index)."""
        self._flush()
        n = len(self.written)
        if n == 1:
            self._shard(0).rename(self.directory / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.written):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            self._shard(i).rename(self.directory / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
