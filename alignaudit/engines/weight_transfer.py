"""Moving the trainer's weights into the rollout engine, and checking what arrived, on the weights' device.

Two transports (alignaudit.rl.loop picks one from the engines' devices; run.json records which):
    file       the trainer writes a safetensors file (CPU tensors), the rollout engine loads it; both sides
               hash every tensor (sha256) and the parent compares the hashes. The CPU path.
    cuda_ipc   the trainer hands out CUDA IPC handles of its own weight tensors (torch.multiprocessing's
               CUDA tensor sharing: torch/multiprocessing/reductions.py, ``reduce_tensor``); the rollout
               engine opens them (no copy, no file: the same device memory the trainer computes with),
               loads them through the model's load_weights and then compares, on the GPU, every tensor it
               holds against the trainer's bit for bit. Both processes must run on the same GPU. RL
               frameworks move weights between co-located engines this way (verl's and slime's colocated
               weight update; torch documents the mechanism in "Multiprocessing best practices").

On both transports the rollout engine measures, before loading, what the update changed against the weights
it held (``update_stats``: elements whose bits changed, max |delta w|). The step's weight digest is, on
``cuda_ipc``, the ``fingerprint`` of what the rollout engine holds after loading (computed on the GPU); on
``file``, the sha256 of the trainer's per-tensor sha256s (alignaudit.rl.loop). Every reduction here is over
integers (bit patterns, counts) or a max, so the numbers do not depend on the device's reduction order.
"""

from __future__ import annotations

import base64
import hashlib
import pickle

import torch

from alignaudit.errors import EngineError

CHUNK = 1 << 24  # elements per pass over a large tensor: each int64 / fp32 temporary is at most 128 / 64 MiB
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (Knuth's multiplicative hashing constant)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` as a flat signed integer tensor of the same element size (no copy when
    ``t`` is contiguous; a whole contiguous copy when it is not). Raises KeyError for an element size other
    than 1, 2, 4 or 8 bytes."""
    return t.detach().contiguous().view(-1).view(_BITS[t.element_size()])


def share(tensors: dict[str, torch.Tensor]) -> str:
    """CUDA IPC handles of ``tensors`` (HF name -> CUDA tensor), as one ASCII string for a JSON message.

    The producer must keep every tensor alive, unchanged, until the consumer has finished with it.
    Raises:
        ValueError: a tensor is not on a CUDA device.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    on_host = [name for name, t in tensors.items() if not t.is_cuda]
    if on_host:
        raise ValueError(f"cuda_ipc transport: {on_host[0]} is on {tensors[on_host[0]].device}, not a CUDA device")
    handles = {name: reduce_tensor(t.detach()) for name, t in tensors.items()}
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


def receive(payload: str) -> dict[str, torch.Tensor]:
    """The tensors of ``share``'s payload, opened in this process (the producer's memory, not a copy).
    The payload is unpickled: accept it only from the trainer this run started."""
    handles = pickle.loads(base64.b64decode(payload))
    return {name: rebuild(*args) for name, (rebuild, args) in handles.items()}


def update_stats(held: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """What loading ``new`` over ``held`` (same names, shapes, dtypes) changes, computed where they live.

    Returns:
        {"elements": elements compared, "changed": elements whose bit pattern differs, "max_abs_dw": max
        |new - held| in fp32 (0.0 when nothing changed)}. Names present on one side only are skipped here;
        ``differing`` reports them.
    """
    names = [n for n in sorted(new) if n in held and held[n].shape == new[n].shape and held[n].dtype == new[n].dtype]
    if not names:
        return {"elements": 0, "changed": 0, "max_abs_dw": 0.0}
    device = new[names[0]].device
    changed = torch.zeros((), dtype=torch.int64, device=device)
    max_abs = torch.zeros((), dtype=torch.float32, device=device)
    elements = 0
    for name in names:
        a, b = bits(held[name]), bits(new[name])
        fa, fb = held[name].detach().contiguous().view(-1), new[name].detach().contiguous().view(-1)
        for start in range(0, a.numel(), CHUNK):
            stop = start + CHUNK
            changed += (a[start:stop] != b[start:stop]).sum()
            max_abs = torch.maximum(max_abs, (fb[start:stop].float() - fa[start:stop].float()).abs().max())
        elements += a.numel()
    return {"elements": elements, "changed": int(changed), "max_abs_dw": float(max_abs)}


def differing(held: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical between the two sides (compared on their device), or that
    one side lacks, or whose shape or dtype differ; sorted. One host sync for all tensors."""
    out = sorted(set(held) ^ set(sent))
    both = sorted(n for n in set(held) & set(sent))
    mismatched = [n for n in both if held[n].shape != sent[n].shape or held[n].dtype != sent[n].dtype]
    compared = [n for n in both if n not in mismatched]
    if compared:
        flags = torch.stack([(bits(held[n]) != bits(sent[n])).any() for n in compared]).tolist()
        mismatched += [n for n, bad in zip(compared, flags, strict=True) if bad]
    return sorted(out + mismatched)


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of every tensor's name, shape, dtype and bit pattern, computed on the tensors' device.

    Per tensor: sum over elements of (bits_i + 1) * (i * 0x9E3779B97F4A7C15 | 1) modulo 2**64 (integer
    arithmetic, so the order of the device's sum does not matter); the per-tensor values and the metadata
    are then hashed with sha256 on the host. It tells weights apart (any single changed element changes its
    tensor's sum); it is not a cryptographic hash of the bytes. Use sha256 (``checksums``) on the CPU.
    """
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    sums = []
    for name in sorted(tensors):
        flat = bits(tensors[name])
        total = torch.zeros((), dtype=torch.int64, device=device)
        for start in range(0, flat.numel(), CHUNK):
            chunk = flat[start : start + CHUNK].to(torch.int64)
            index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=device)
            total += ((chunk + 1) * (index * _GOLDEN | 1)).sum()
        sums.append(total)
    values = torch.stack(sums).tolist() if sums else []
    h = hashlib.sha256()
    for name, value in zip(sorted(tensors), values, strict=True):
        t = tensors[name]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{value}\n".encode())
    return h.hexdigest()


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{hf_name: sha256 of the tensor's bytes (dtype and layout as stored, contiguous)}``."""
    return {
        name: hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().data).hexdigest()
        for name, t in sorted(tensors.items())
    }


def load_and_check(held, load, stale, transport: str, path: str | None, handles: str | None) -> dict:
    """The rollout side of one weight sync, wherever the model lives (the rl worker, or vLLM's own worker process in
    --engine-mode async): the trainer's weights read from ``path`` (``file``: a safetensors file) or opened from
    ``handles`` (``cuda_ipc``: ``share``'s payload), measured against the weights held before (``update_stats``),
    loaded, then checked.

    Args:
        held: () -> the weights the engine computes with, in HF names. load: (tensors) -> None, the engine's load.
        stale: () -> the layers whose packed GEMM does not compute with their weight ([] where nothing is packed).
    Returns:
        {"update", "stale"} and, for ``file``, "checksums" (every held tensor's sha256; the parent compares them
        with the trainer's); for ``cuda_ipc``, "differing" (held tensors whose bits differ from the trainer's own
        memory), "tensors" and "digest" (``fingerprint`` of what is held).
    """
    if transport == "cuda_ipc":
        if handles is None:
            raise EngineError("a cuda_ipc weight sync needs the trainer's handles; none came")
        new = receive(handles)
    else:
        from safetensors.torch import load_file

        if path is None:
            raise EngineError("a file weight sync needs the trainer's safetensors file; none was named")
        new = load_file(path)
    reply: dict[str, object] = {"update": update_stats(held(), new)}
    load(new)
    now = held()
    if transport == "cuda_ipc":
        reply["differing"], reply["tensors"], reply["digest"] = differing(now, new), len(now), fingerprint(now)
        del new, now
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()  # release the trainer's blocks this process no longer maps
    else:
        reply["checksums"] = checksums(now)
    reply["stale"] = stale()
    return reply
