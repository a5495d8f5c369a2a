"""Capture workers forked from interpreters that have already imported the engine: the test session's launcher.

    python -m alignaudit.workers.preloaded ENGINE[,ENGINE...] FD   (started by Preloaded; FD: its socket)

A one-shot capture worker (alignaudit.workers.capture_worker) spends most of a small capture importing: on 2 CPU
cores, torch 3 s, vLLM 9 s, megatron-core 5 s, transformers 4 s, against 1-2 s of forward pass on the fixture
(2026-12-02). A preloaded server imports torch, alignaudit's worker modules and the named engines' libraries
once, then forks one child per worker launch; the child takes the launch's output pipe, working directory,
environment and arguments and runs ``python -m alignaudit.workers.capture_worker ARGS`` as that command
would (runpy, ``__main__``, the exit code of its ``SystemExit``), so every capture still builds its engine
in a process of its own, and the child exits when the capture is done.

What stays equal to a fresh worker: each engine is built, run and torn down in its own process; nothing runs in
the server but imports (no engine, no torch computation, no threads: forking a process with an OpenMP pool
would be unsafe), one hash every vLLM worker computes anyway (Inductor's triton_key) and ``gc.freeze()``, which
hides the imported objects from each worker's garbage collections (2026-12-04, 2 cores: a vLLM capture on the
fixture 6.6-7.2 s -> 4.7-5.3 s from fork to result). The server imports only the libraries a worker for those
engines imports anyway, and a server serves only launches whose environment is the one it started with
(variables read at import time would otherwise differ: a launch under another environment gets a server of its
own).

Not used by the CLI: a command runs two or three workers, each importing a different engine, so preloading
saves nothing there. alignaudit's tests install it (tests/conftest.py) through
``alignaudit.workers.spawn.start_worker``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

WORKER_MODULE = "alignaudit.workers.capture_worker"
SESSION_MODULE = "alignaudit.workers.rl_session"  # the RL loop's long-lived workers (stdin commands, stdout replies)
# Differs from launch to launch without changing what a worker computes: pytest names the running test, and
# `rl --log-to wandb` leaves W&B's service socket in the environment of the process that ran it (every later launch
# of that test process got servers of its own, importing their engines again).
IGNORED_ENV = ("PYTEST_CURRENT_TEST", "WANDB_SERVICE")

# What a worker for each engine imports before it builds the engine (alignaudit.engines.*.adapter and the
# modules its constructor and start import); run_rank's own imports come first.
PRELOAD = {
    "vllm": (
        "vllm",
        "vllm.entrypoints.llm",
        "vllm.engine.arg_utils",
        "vllm.sampling_params",
        "vllm.v1.worker.cpu_worker",
    ),
    "megatron": (
        "megatron.core.parallel_state",
        "megatron.core.transformer.transformer_config",
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.transformer.module",
        "megatron.core.tensor_parallel",
    ),
    "hf": (
        "transformers",
        "transformers.modeling_utils",
        "transformers.models.auto.modeling_auto",
        "transformers.generation",
    ),
}


def engines_of(args: list[str]) -> tuple[str, ...] | None:
    """The engines a capture_worker launch imports: the request's engine, or those of an option check; None
    when the arguments are not understood (such a launch gets a fresh process)."""
    try:
        if args[0] == "--check-options":
            return tuple(sorted({check["engine"] for check in json.loads(args[1])}))
        return (json.loads(Path(args[0]).read_text())["engine"],)
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return None


class Preloaded:
    """Preloaded servers, one per set of engines, started on first use and stopped with ``close``.

    A server serves one set of engines under one environment (up to IGNORED_ENV): it imported under that
    environment. ``start_worker(args, env)`` has the signature of alignaudit.workers.spawn.start_worker and
    returns a ForkedWorker, or ``fresh(args, env)`` (spawn's own fresh process) for a launch no server may serve:
    arguments it does not understand, while that server is busy, or with ``max_servers`` servers running.
    ``start_session`` does the same for the RL loop's session workers (spawn.start_session's signature).
    """

    def __init__(self, fresh, max_servers: int = 6, fresh_session=None):
        from alignaudit.workers.spawn import start_session

        self.fresh = fresh  # spawn's launcher: (args, env) -> subprocess.Popen
        self.fresh_session = fresh_session or start_session  # (args, env, stderr) -> subprocess.Popen
        self.max_servers = max_servers  # each holds its imports in memory (0.4-0.7 GB RSS)
        self.servers: dict[tuple, _Server] = {}
        self.lock = threading.Lock()

    def start_worker(self, args: list[str], env: dict[str, str]):
        return self._launch(args, env, lambda: self.fresh(args, env), WORKER_MODULE)

    def start_session(self, args: list[str], env: dict[str, str], stderr):
        """An RL session worker (alignaudit.workers.rl_session), as spawn.start_session starts one: commands on its
        ``stdin``, replies on its ``stdout``, its stderr into the open file ``stderr``."""
        return self._launch(
            args, env, lambda: self.fresh_session(args, env, stderr), SESSION_MODULE, stdin=True, stderr=stderr
        )

    def _launch(self, args, env, fresh, module, stdin=False, stderr=None):
        engines = engines_of(args)
        if not engines or not set(engines) <= set(PRELOAD):
            return fresh()
        key = (engines, tuple(sorted(_comparable(env).items())))
        with self.lock:
            server = self.servers.get(key)
            if server is not None and not server.alive():
                del self.servers[key]
                server = None
            if server is None:
                if len(self.servers) >= self.max_servers:
                    return fresh()
                server = self.servers[key] = _Server(engines, env)
        if not server.busy.acquire(blocking=False):
            return fresh()
        try:
            return ForkedWorker(server, args, env, module, stdin, stderr)
        except OSError:
            server.busy.release()
            return fresh()

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


class _Server:
    def __init__(self, engines: tuple[str, ...], env: dict[str, str]):
        from alignaudit.workers.spawn import _die_with_parent, python_module

        self.busy = threading.Lock()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [*python_module("alignaudit.workers.preloaded"), ",".join(engines), str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            pass_fds=(theirs.fileno(),),
            preexec_fn=_die_with_parent,
        )
        theirs.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Stop the server: it holds imports only (its workers have exited), so it is killed rather than left to
        run the interpreter's shutdown of vLLM and megatron-core (seconds each on 2 cores)."""
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in IGNORED_ENV}


class ForkedWorker:
    """A worker forked by a preloaded server, with the part of subprocess.Popen that spawn and the RL session use:
    ``stdout`` (text; the worker's stdout, and its stderr too unless ``stderr`` is an open file), ``stdin`` (text,
    when asked for; else the worker reads /dev/null), ``wait``, ``poll``, ``kill``, ``returncode``."""

    def __init__(
        self,
        server: _Server,
        args: list[str],
        env: dict[str, str],
        module: str = WORKER_MODULE,
        stdin: bool = False,
        stderr=None,
    ):
        self.server, self.module = server, module
        self.returncode: int | None = None
        self.stdin: IO[str] | None = None
        read, write = os.pipe()
        mine, theirs, names = [read], [write], ["stdout"]
        if stderr is not None:
            theirs.append(os.dup(stderr.fileno()))
            names.append("stderr")
        if stdin:
            child_in, parent_in = os.pipe()
            mine.append(parent_in)
            theirs.append(child_in)
            names.append("stdin")
        try:
            message = json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "module": module, "fds": names})
            socket.send_fds(server.sock, [message.encode()], theirs)
        except OSError:
            for fd in mine:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        self.stdout = open(read, encoding=None, errors="replace")  # noqa: SIM115 (the worker's life; closed in wait)
        if stdin:
            self.stdin = open(parent_in, "w")  # noqa: SIM115 (the worker's life)
        self.pid = self._reply()["pid"]

    def _reply(self) -> dict:
        data = self.server.sock.recv(1 << 16)
        if not data:  # the server died (it takes its forked worker with it)
            return {"pid": -1, "exit": -signal.SIGKILL}
        return json.loads(data)

    def wait(self, timeout=None) -> int:
        """The worker's exit code; subprocess.TimeoutExpired if it has not exited within ``timeout`` seconds."""
        if self.returncode is None:
            if timeout is not None and not select.select([self.server.sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.module, timeout)
            reply = self._reply()
            self.returncode = reply["exit"]
            self.server.busy.release()
        return self.returncode

    def poll(self):
        if self.returncode is None and select.select([self.server.sock], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None and self.pid > 0:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def serve(engines: list[str], fd: int) -> None:
    """The server: import, then fork one worker per launch received on socket ``fd`` until it closes."""
    import gc
    import importlib

    import torch  # noqa: F401

    from alignaudit.capture import directory, environment  # noqa: F401  (what run_rank imports)
    from alignaudit.engines import load_engine_class

    for engine in engines:
        load_engine_class(engine)
        for module in PRELOAD[engine]:
            importlib.import_module(module)
    if "vllm" in engines:
        from torch._inductor.codecache import triton_key

        triton_key()  # a hash of Triton's sources, cached per process: each vLLM worker's compile asked for it
    # Every object the imports made is old and is never garbage: out of the collector's sight (Python's gc docs:
    # freeze before fork), a worker's gc.collect() walks only its own objects (vLLM's model loader runs two).
    gc.freeze()
    sock = socket.socket(fileno=fd)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not message:
            return
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(request, dict(zip(request["fds"], fds, strict=True)))
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        sock.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict, fds: dict[str, int]) -> None:
    """Become ``python -m MODULE ARGS`` (capture_worker unless the request names rl_session) in ``cwd`` with
    ``env``, on the received ``fds`` ("stdout"; "stderr", else stdout; "stdin", else /dev/null); never returns."""
    import runpy
    import traceback

    from alignaudit.workers.spawn import _die_with_parent

    code = 1
    module = request.get("module", WORKER_MODULE)
    try:
        if module not in (WORKER_MODULE, SESSION_MODULE):
            raise ValueError(f"a preloaded server runs {WORKER_MODULE} or {SESSION_MODULE}, not {module}")
        if "stdin" not in fds:
            fds["stdin"] = os.open(os.devnull, os.O_RDONLY)
        for name, target in (("stdout", 1), ("stderr", 2), ("stdin", 0)):
            os.dup2(fds.get(name, fds["stdout"]), target)
        for fd in set(fds.values()):
            os.close(fd)
        _die_with_parent()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [module, *request["args"]]
        sys.path[0] = request["cwd"]  # as `python -m` sets it
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1].split(","), int(sys.argv[2]))
