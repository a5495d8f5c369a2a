"""Long-lived engine workers for the RL loop: one process per engine, commands in, replies out.

    python -m alignaudit.workers.rl_session REQUEST.json

The parent writes one JSON command per line on the worker's stdin and reads one reply line, marked with
``REPLY_MARKER``, from its stdout; anything else the worker prints goes to its log file (stderr goes there
directly). Tokens and logprobs travel as JSON (an fp32 value survives the trip through a Python float
exactly); weights travel as a safetensors file the parent names (CPU) or as CUDA IPC handles of the
trainer's own tensors (alignaudit.rl.weight_transfer). A library error comes back as
``{"error": {"type", "message"}}`` and is re-raised in the parent with its type; a worker that dies is an
EngineError carrying the last lines of its log.

Commands: ``start`` (size the engine), ``rollout``, ``score`` (both: with ``vocab_rows``, rl --full-vocab, the
engine's full-vocabulary rows of the generated tokens into a file, _RowFile), ``train_step``, ``export``
(trainer weights: to a file with checksums, or as CUDA IPC handles), ``load_weights`` (rollout engine: load
them, answering with what the update changed and the check of what the engine then holds), ``checksums``,
``settings``, ``close``.

A Megatron trainer at tensor-parallel size t > 1 is t processes: the worker is rank 0 and starts ranks
1..t-1, which follow it: rank 0 broadcasts each command (torch.distributed.broadcast_object_list), every
rank runs it (the forward passes, the optimizer step and the weight export are collective), rank 0 replies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections import deque
from pathlib import Path

from alignaudit import errors
from alignaudit.workers.capture_worker import ranks_to_spawn, start_ranks

REPLY_MARKER = "ALIGNAUDIT-REPLY "


class Session:
    """The parent's handle on one worker.

    Args:
        request: {"role": "trainer" | "rollout", "engine", "spec", "settings", and for a trainer "lr",
            "clip_grad", "offload_fraction", "kl_coef"}. log: the worker's log file.
    Raises:
        EngineError: the worker died (its last log lines in the message).
    """

    def __init__(self, request: dict, log: Path):
        from alignaudit.workers import spawn

        self.request, self.log = request, Path(log)
        path = self.log.with_suffix(".request.json")
        path.write_text(json.dumps(request, indent=2) + "\n")
        self._log = open(self.log, "w")  # noqa: SIM115 (the session's life; closed in close)
        self.proc = spawn.start_session([str(path)], {**os.environ, "PYTHONUNBUFFERED": "1"}, self._log)

    def call(self, command: str, **args) -> dict:
        """Send a command; return its reply. Raises the worker's own error type, or EngineError."""
        try:
            self.proc.stdin.write(json.dumps({"command": command, **args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        for line in self.proc.stdout:
            if line.startswith(REPLY_MARKER):
                reply = json.loads(line[len(REPLY_MARKER):])
                if "error" in reply:
                    raise getattr(errors, reply["error"]["type"], errors.EngineError)(reply["error"]["message"])
                return reply
            self._log.write(line)
            self._log.flush()
        raise self._died()

    def _died(self) -> errors.EngineError:
        code = self.proc.wait()
        self._log.flush()
        tail: deque[str] = deque(maxlen=8)
        with open(self.log, errors="replace") as f:
            for line in f:
                if line.strip():
                    tail.append(line.rstrip())
        last = "\n  ".join(tail)
        return errors.EngineError(f"{self.request['engine']} {self.request['role']} worker died (exit code {code}); "
                                  f"full log: {self.log}; last lines:\n  {last}")

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call("close")
                self.proc.wait(timeout=30)
            except (errors.AlignAuditError, OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# --- worker side -------------------------------------------------------------------------------------


class Worker:
    """The engine (and, for a trainer, its optimizer) a session drives; ``rank`` > 0 for the followers of a
    tensor-parallel trainer, which never write files."""

    def __init__(self, request: dict, rank: int = 0):
        from alignaudit.engines import load_engine_class
        from alignaudit.inputs.checkpoint import ModelSpec
        from alignaudit.inputs.request import EngineSettings

        started = time.perf_counter()
        self.role, self.rank = request["role"], rank
        self.spec = ModelSpec(**request["spec"])
        settings = EngineSettings(**request["settings"])
        adapter = load_engine_class(request["engine"])
        adapter.prepare_for_weight_updates()
        self.engine = adapter(self.spec, settings)
        built = time.perf_counter()
        self.startup_s = {"imports_and_engine": round(built - started, 3)}  # seconds, recorded in run.json
        self.trainer = None
        if self.role == "trainer":
            from alignaudit.rl.trainer import Trainer

            self.trainer = Trainer(self.engine, request["lr"], request["clip_grad"],
                                   request.get("offload_fraction", 0.0), request.get("kl_coef", 0.0))
            self.startup_s["ddp_and_optimizer"] = round(time.perf_counter() - built, 3)

    def handle(self, command: str, args: dict) -> dict:
        from alignaudit.inputs.prompts import TokenBatch

        if command == "start":
            self.engine.start(args["max_len"], args["total_tokens"], args.get("max_seqs"))
            return {}
        if command == "settings":
            record = {"engine": self.engine.name, **self.engine.settings_record(), "worker_startup_s": self.startup_s}
            if self.trainer is not None:
                record["optimizer"] = self.trainer.optimizer_name
                import torch

                record["host_threads"] = torch.get_num_threads()  # what a host-side (offloaded, CPU) Adam runs on
            return {"settings": record}
        if command == "rollout":
            from alignaudit.inputs.request import Sampling

            batch = TokenBatch(tuple(tuple(s) for s in args["prompts"]))
            with _RowFile(self.engine, args.get("vocab_rows"), [0] * len(batch.sequences)):
                full, logprobs = self.engine.rollout(batch, Sampling(**args["sampling"]))
            return {"sequences": [list(s) for s in full.sequences], "logprobs": [lp.tolist() for lp in logprobs],
                    "prefix_cache_hits": getattr(self.engine, "prefix_cache_hits", None)}
        if command == "sleep":
            return self.engine.sleep(args["level"])
        if command == "wake_up":
            return self.engine.wake_up()
        if command == "score":
            batch = TokenBatch(tuple(tuple(s) for s in args["sequences"]))
            rows = args.get("vocab_rows")
            with _RowFile(self.engine, rows, [p - 1 for p in rows["prompt_lengths"]] if rows else None):
                scored = self.trainer.score(batch, args.get("replay"))
            return {"logprobs": [lp.tolist() for lp in scored]}
        if command == "train_step":
            batch = TokenBatch(tuple(tuple(s) for s in args.pop("sequences")))
            return self.trainer.train_step(batch, **args)
        if command == "export":
            return self._export(args)
        if command == "load_weights":
            return self._load_weights(args)
        if command == "checksums":
            from alignaudit.engines.base import checksums

            return {"checksums": checksums(self.engine.hf_weights())}
        raise errors.InputError(f"unknown session command {command!r}")

    def _export(self, args: dict) -> dict:
        """The trainer's weights for the rollout engine (collective at tensor-parallel size > 1: every rank
        gathers, rank 0 hands them out). ``file``: a safetensors file at args["path"] and every tensor's
        sha256. ``cuda_ipc``: CUDA IPC handles of the tensors themselves, kept alive here until the next
        export (weight_transfer.share)."""
        from alignaudit.engines.base import checksums
        from alignaudit.rl import weight_transfer

        tensors, diverged = self.trainer.weights()
        reply: dict = {"replicas_diverged": diverged}
        if args["transport"] == "cuda_ipc":
            self._shared = tensors  # the rollout engine reads this memory; it must outlive the load
            if self.rank == 0:
                reply["handles"] = weight_transfer.share(tensors)
            return reply
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        if self.rank == 0:
            from safetensors.torch import save_file

            save_file(tensors, args["path"])
        return {**reply, "checksums": checksums(tensors)}

    def _load_weights(self, args: dict) -> dict:
        """The trainer's weights into the running rollout engine (engine.load_weights), measured against the
        weights it held before (weight_transfer.update_stats) and checked after: ``file``: every held
        tensor's sha256 (the parent compares them with the trainer's) and the packed-GEMM probe;
        ``cuda_ipc``: every held tensor against the trainer's own memory, bit for bit on the GPU, and a
        device fingerprint of what is held."""
        from alignaudit.engines.base import checksums
        from alignaudit.rl import weight_transfer

        if args["transport"] == "cuda_ipc":
            new = weight_transfer.receive(args["handles"])
        else:
            from safetensors.torch import load_file

            new = load_file(args["path"])
        reply = {"update": weight_transfer.update_stats(self.engine.hf_weights(), new)}
        self.engine.load_weights(new)
        held = self.engine.hf_weights()
        if args["transport"] == "cuda_ipc":
            reply["differing"], reply["tensors"] = weight_transfer.differing(held, new), len(held)
            reply["digest"] = weight_transfer.fingerprint(held)
            del new, held
            import torch

            torch.cuda.synchronize()
            torch.cuda.ipc_collect()  # release the trainer's blocks this process no longer maps
        else:
            reply["checksums"] = checksums(held)
        reply["stale"] = self.engine.stale_packed_layers() if hasattr(self.engine, "stale_packed_layers") else []
        return reply


class _RowFile:
    """rl --full-vocab, around one rollout or score: the engine's full-vocabulary rows (Engine.vocab_sink) of each
    sequence from row ``first[seq]`` on, concatenated in sequence order into one float32 tensor [rows, V] named
    ``spec["tensor"]`` in the safetensors file ``spec["path"]`` (the parent reads it: alignaudit.rl.loop). Holds
    on the host 4 x V bytes per row kept until the file is written. ``spec`` None: nothing. One rank only (the rl
    command refuses --full-vocab at tensor-parallel size > 1, engines.checks.check_rl_full_vocab)."""

    def __init__(self, engine, spec: dict | None, first: list[int] | None):
        self.engine, self.spec, self.first = engine, spec, first
        self.pieces: dict = {}

    def __enter__(self):
        if self.spec is not None:
            def sink(seq, rows):
                if seq in self.pieces:
                    raise errors.EngineError(f"full-vocabulary rows of sequence {seq} came twice")
                self.pieces[seq] = rows[self.first[seq]:].detach().to("cpu", copy=True).contiguous()
            self.engine.vocab_sink = sink
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.engine.vocab_sink = None
        if self.spec is None or kind is not None:
            return
        missing = [s for s in range(len(self.first)) if s not in self.pieces]
        if missing:
            raise errors.EngineError(f"full-vocabulary rows: sequences {missing[:5]} got none from {self.engine.name}")
        import torch
        from safetensors.torch import save_file

        rows = torch.cat([self.pieces[s] for s in range(len(self.first))])
        self.pieces.clear()
        save_file({self.spec["tensor"]: rows}, self.spec["path"])


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    out = sys.stdout
    sys.stdout = sys.stderr  # everything the engines print goes to the log; stdout carries replies only
    tp = ranks_to_spawn(request)
    if tp > 1:
        _start_followers(request, tp)
    try:
        worker = Worker(request)
    except errors.AlignAuditError as e:
        traceback.print_exc()
        _reply(out, {"error": {"type": type(e).__name__, "message": str(e)}})
        _drain_until_close(out)
        return
    for line in sys.stdin:
        message = json.loads(line)
        if tp > 1:
            _broadcast(message)
        command = message.pop("command")
        if command == "close":
            _reply(out, {})
            break
        try:
            _reply(out, worker.handle(command, message))
        except errors.AlignAuditError as e:
            traceback.print_exc()
            _reply(out, {"error": {"type": type(e).__name__, "message": str(e)}})


def _start_followers(request: dict, tp: int) -> None:
    """Ranks 1..tp-1 of a tensor-parallel Megatron trainer, each following rank 0's commands."""
    from alignaudit.engines.megatron.adapter import RANK_ENV, WORLD_ENV

    os.environ[RANK_ENV], os.environ[WORLD_ENV] = "0", str(tp)
    start_ranks(_follow, request, tp, nprocs=tp - 1, join=False)


def _follow(index: int, request: dict, tp: int) -> None:
    from alignaudit.engines.megatron.adapter import RANK_ENV
    from alignaudit.workers.spawn import _die_with_parent

    _die_with_parent()
    os.environ[RANK_ENV] = str(index + 1)
    worker = Worker(request, rank=index + 1)
    while True:
        message = _broadcast(None)
        command = message.pop("command")
        if command == "close":
            return
        try:
            worker.handle(command, message)
        except errors.AlignAuditError:
            traceback.print_exc()  # rank 0 meets the same error and reports it


def _broadcast(message: dict | None) -> dict:
    """Rank 0's command to every rank (the others pass None and receive it)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _drain_until_close(out) -> None:
    """After a failed start, answer every command with the start error's reply until told to close."""
    for line in sys.stdin:
        if json.loads(line).get("command") == "close":
            _reply(out, {})
            return
        _reply(out, {"error": {"type": "EngineError", "message": "the worker failed to start; see its log"}})


def _reply(out, record: dict) -> None:
    out.write(REPLY_MARKER + json.dumps(record) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
