"""Long-lived engine workers for the RL loop: one process per engine, commands in, replies out.

    python -m alignaudit.workers.rl_session REQUEST.json

The parent (alignaudit.workers.session.Session) writes one JSON command per line on the worker's stdin and reads
one reply line, marked with ``REPLY_MARKER``, from its stdout; anything else the worker prints goes to its log file
(stderr goes there directly). Tokens and logprobs travel as JSON (an fp32 value survives the trip through a Python float
exactly); weights travel as a safetensors file the parent names (CPU) or as CUDA IPC handles of the
trainer's own tensors (alignaudit.engines.weight_transfer). A library error comes back as
``{"error": {"type", "message"}}`` and is re-raised in the parent with its type; a worker that dies is an
EngineError carrying the last lines of its log.

Commands (``Worker.COMMANDS``, a table of command to method): ``start`` (size the engine), ``rollout``, ``score``
(both: with ``vocab_rows``, rl --full-vocab, the engine's full-vocabulary rows of the generated tokens into a file,
_RowFile), ``train_step``, ``export`` (trainer weights: to a file with checksums, or as CUDA IPC handles),
``load_weights`` (rollout engine: load them, answering with what the update changed and the check of what the engine
then holds), ``checksums``, ``settings``, ``sleep``, ``wake_up``; ``close`` ends the loop (``main``).

A Megatron trainer at tensor-parallel size t > 1 is t processes: the worker is rank 0 and starts ranks
1..t-1, which follow it: rank 0 broadcasts each command (torch.distributed.broadcast_object_list), every
rank runs it (the forward passes, the optimizer step and the weight export are collective), rank 0 replies.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from alignaudit import errors
from alignaudit.engines import load_engine_class, weight_transfer
from alignaudit.engines.weight_transfer import checksums
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import Replay, Sampling
from alignaudit.training.trainer import Trainer
from alignaudit.workers.capture_worker import ranks_to_spawn, start_ranks
from alignaudit.workers.job import SessionJob
from alignaudit.workers.session import REPLY_MARKER
from alignaudit.workers.spawn import _die_with_parent


class Worker:
    """The engine (and, for a trainer, its optimizer) a session drives; ``rank`` > 0 for the followers of a
    tensor-parallel trainer, which never write files."""

    # command -> the method that runs it, with the command's arguments (a dict) -> the reply (a dict)
    COMMANDS = {
        "start": "_start",
        "settings": "_settings",
        "rollout": "_rollout",
        "sleep": "_sleep",
        "wake_up": "_wake_up",
        "score": "_score",
        "train_step": "_train_step",
        "export": "_export",
        "load_weights": "_load_weights",
        "checksums": "_checksums",
    }

    def __init__(self, job: SessionJob, rank: int = 0):
        started = time.perf_counter()
        self.role, self.rank, self.spec = job.role, rank, job.spec
        adapter = load_engine_class(job.engine)
        adapter.prepare_for_weight_updates()
        self.engine = adapter(self.spec, job.settings)
        built = time.perf_counter()
        self.startup_s = {"imports_and_engine": round(built - started, 3)}  # seconds, recorded in run.json
        self.trainer = None
        if self.role == "trainer":
            self.trainer = Trainer(self.engine, job.lr, job.clip_grad, job.offload_fraction, job.kl_coef)
            self.startup_s["ddp_and_optimizer"] = round(time.perf_counter() - built, 3)

    def handle(self, command: str, args: dict) -> dict:
        """Run one command (``COMMANDS``) with its arguments; return the reply. Raises InputError for a command
        the table does not hold, and whatever the engine raises."""
        if command not in self.COMMANDS:
            raise errors.InputError(f"unknown session command {command!r}; known: {', '.join(self.COMMANDS)}")
        return getattr(self, self.COMMANDS[command])(args)

    def _trainer(self) -> Trainer:
        """The trainer of a trainer worker. Raises InputError in a rollout worker (a trainer's command sent to it)."""
        if self.trainer is None:
            raise errors.InputError(f"a trainer's command sent to the {self.role} worker, which has no trainer")
        return self.trainer

    def _start(self, args: dict) -> dict:
        self.engine.start(
            args["max_len"], args["total_tokens"], args.get("max_seqs"), args.get("engine_mode", "offline")
        )
        return {}

    def _settings(self, args: dict) -> dict:
        # the trainer's record as it scores: with the replay every step's score and update get (processed logprobs)
        held, self.engine.replay = self.engine.replay, Replay.from_dict(args.get("replay"))
        try:
            record = {"engine": self.engine.name, **self.engine.settings_record(), "worker_startup_s": self.startup_s}
        finally:
            self.engine.replay = held
        if self.trainer is not None:
            record["optimizer"] = self.trainer.optimizer_name
            record["host_threads"] = torch.get_num_threads()  # what a host-side (offloaded, CPU) Adam runs on
            if self.engine.settings.strict_ops:  # ALIGNAUDIT_BACKWARD: how the strict ops' gradients are computed
                from alignaudit_kernels.gradients import backward_on

                record["strict_backward"] = backward_on(self.engine.settings.device == "cuda")
        return {"settings": record}

    def _rollout(self, args: dict) -> dict:
        batch = _batch(args["prompts"])
        with _RowFile(self.engine, args.get("vocab_rows"), [0] * len(batch.sequences)):
            full, logprobs = self.engine.rollout(batch, Sampling(**args["sampling"]))
        return {
            "sequences": [list(s) for s in full.sequences],
            "logprobs": [lp.tolist() for lp in logprobs],
            "prefix_cache_hits": getattr(self.engine, "prefix_cache_hits", None),
            "arrivals": arrivals.to_dict() if (arrivals := getattr(self.engine, "arrivals", None)) else None,
        }

    def _sleep(self, args: dict) -> dict:
        return self.engine.sleep(args["level"])

    def _wake_up(self, args: dict) -> dict:
        return self.engine.wake_up()

    def _score(self, args: dict) -> dict:
        batch, rows = _batch(args["sequences"]), args.get("vocab_rows")
        with _RowFile(self.engine, rows, [p - 1 for p in rows["prompt_lengths"]] if rows else []):
            scored = self._trainer().score(batch, Replay.from_dict(args.get("replay")))
        return {"logprobs": [lp.tolist() for lp in scored]}

    def _train_step(self, args: dict) -> dict:
        replay = Replay.from_dict(args.pop("replay", None))
        return self._trainer().train_step(_batch(args.pop("sequences")), replay=replay, **args)

    def _checksums(self, args: dict) -> dict:
        return {"checksums": self.engine.weight_checksums()}

    def _export(self, args: dict) -> dict:
        """The trainer's weights for the rollout engine (collective at tensor-parallel size > 1: every rank
        gathers, rank 0 hands them out). ``file``: a safetensors file at args["path"] and every tensor's
        sha256. ``cuda_ipc``: CUDA IPC handles of the tensors themselves, kept alive here until the next
        export (weight_transfer.share)."""

        tensors, diverged = self._trainer().weights()
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
        """The trainer's weights into the running rollout engine, measured against the weights it held before and
        checked after (Engine.sync_weights; weight_transfer.load_and_check gives the reply)."""
        return self.engine.sync_weights(args["transport"], args.get("path"), args.get("handles"))


def _batch(sequences: list[list[int]]) -> TokenBatch:
    return TokenBatch(tuple(tuple(s) for s in sequences))


class _RowFile:
    """rl --full-vocab, around one rollout or score: the engine's full-vocabulary rows (Engine.vocab_sink) of each
    sequence from row ``first[seq]`` on, concatenated in sequence order into one float32 tensor [rows, V] named
    ``spec["tensor"]`` in the safetensors file ``spec["path"]`` (the parent reads it: alignaudit.rl.loop). Holds
    on the host 4 x V bytes per row kept until the file is written. ``spec`` None: nothing. One rank only (the rl
    command refuses --full-vocab at tensor-parallel size > 1, engines.checks.check_rl_full_vocab)."""

    def __init__(self, engine, spec: dict | None, first: list[int]):
        self.engine, self.spec, self.first = engine, spec, first
        self.pieces: dict = {}

    def __enter__(self):
        if self.spec is not None:

            def sink(seq, rows):
                if seq in self.pieces:
                    raise errors.EngineError(f"full-vocabulary rows of sequence {seq} came twice")
                self.pieces[seq] = rows[self.first[seq] :].detach().to("cpu", copy=True).contiguous()

            self.engine.vocab_sink = sink
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.engine.vocab_sink = None
        if self.spec is None or kind is not None:
            return
        missing = [s for s in range(len(self.first)) if s not in self.pieces]
        if missing:
            raise errors.EngineError(f"full-vocabulary rows: sequences {missing[:5]} got none from {self.engine.name}")
        from safetensors.torch import save_file

        rows = torch.cat([self.pieces[s] for s in range(len(self.first))])
        self.pieces.clear()
        save_file({self.spec["tensor"]: rows}, self.spec["path"])


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # everything the engines print goes to the log; stdout carries replies only
    try:
        job = SessionJob.read(Path(sys.argv[1]))
        tp = ranks_to_spawn(job.engine, job.settings)
        if tp > 1:
            _start_followers(job, tp)
        worker = Worker(job)
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


def _start_followers(job: SessionJob, tp: int) -> None:
    """Ranks 1..tp-1 of a tensor-parallel Megatron trainer, each following rank 0's commands."""
    from alignaudit.engines.megatron.adapter import RANK_ENV, WORLD_ENV

    os.environ[RANK_ENV], os.environ[WORLD_ENV] = "0", str(tp)
    start_ranks(_follow, job, job.settings, tp, nprocs=tp - 1, join=False)


def _follow(index: int, job: SessionJob, tp: int) -> None:
    from alignaudit.engines.megatron.adapter import RANK_ENV

    _die_with_parent()
    os.environ[RANK_ENV] = str(index + 1)
    worker = Worker(job, rank=index + 1)
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

    box: list[Any] = [message]  # holds rank 0's message on every rank after the broadcast
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
