"""Rollouts through vLLM's asynchronous front end (``AsyncLLM``), as verl's agent loop, NeMo-RL's async vLLM worker
and an OpenAI-compatible server submit them: the engine core runs in a process of its own and requests arrive one
at a time while earlier ones decode, so a request joins a batch already running, its prompt's prefill lands in a
decode step, and the batch grows and shrinks under the kernels (vllm #51187, #51902: where vLLM's own batch
invariance broke in public reports).

Request ``i`` is submitted ``i * gap`` seconds after the first; every request asks for its final output only
(``RequestOutputKind.FINAL_ONLY``, which ``LLM.generate`` also uses, and the one kind under which ``n > 1`` returns
all ``n`` completions in one output). How the arrivals overlapped is measured, not assumed (Arrivals).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from alignaudit.engines.vllm.worker_extension import EXTENSION


@dataclass(frozen=True)
class Arrivals:
    """How one async rollout's requests arrived, as the client saw them (times in seconds from the first
    submission; a request is running from its submission until its final output reaches the client).

    Attributes:
        requests: requests submitted. gap_s: the gap asked for between two submissions.
        arrived_while_running: requests submitted while at least one earlier request was still running.
        max_running: the most requests running at one time.
        span_s: from the first submission to the last final output.
    """

    requests: int
    gap_s: float
    arrived_while_running: int
    max_running: int
    span_s: float

    @classmethod
    def of(cls, gap_s: float, sent: list[float], done: list[float]) -> Arrivals:
        """From each request's submission and completion time (``sent[i] <= done[i]``)."""
        running = [sum(1 for j in range(len(sent)) if sent[j] <= sent[i] < done[j]) for i in range(len(sent))]
        overlapped = sum(1 for i in range(len(sent)) if any(sent[j] <= sent[i] < done[j] for j in range(i)))
        return cls(len(sent), gap_s, overlapped, max(running, default=0), round(max(done, default=0.0), 3))

    def to_dict(self) -> dict:
        return asdict(self)


class AsyncRollout:
    """One ``AsyncLLM`` driven from synchronous code through an event loop of its own, kept for the engine's life.

    Args:
        kwargs: vLLM EngineArgs fields (as ``LLM(**kwargs)`` takes them). alignaudit adds its worker extension
            (worker_extension.EXTENSION) and, unless given, ``disable_log_stats=True`` (``LLM``'s default).
    Raises:
        ValueError, TypeError: vLLM rejected the settings.
    """

    def __init__(self, kwargs: dict):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.kwargs = {"disable_log_stats": True, **kwargs, "worker_extension_cls": EXTENSION}
        self.loop = asyncio.new_event_loop()
        self.calls = 0

        async def build():  # inside the loop, so that AsyncLLM's output handler binds to it
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.kwargs))

        self.engine = self.loop.run_until_complete(build())

    @property
    def vllm_config(self):
        return self.engine.vllm_config

    def rpc(self, method: str, *args):
        """A method of worker_extension.KernelReadback, by name, run in vLLM's worker process; its result."""
        return self.loop.run_until_complete(self.engine.collective_rpc(method, args=args))[0]

    def kernels(self) -> dict:
        """weights.kernels_of the model in vLLM's worker process (worker_extension)."""
        return self.rpc("alignaudit_kernels")

    def reset_prefix_cache(self) -> None:
        self.loop.run_until_complete(self.engine.reset_prefix_cache())

    def sleep(self, level: int) -> None:
        """AsyncLLM.sleep: as LLM.sleep, for the engine core in its own process."""
        self.loop.run_until_complete(self.engine.sleep(level))

    def wake_up(self) -> None:
        self.loop.run_until_complete(self.engine.wake_up())

    def generate(self, sequences, params: list, gap_s: float, progress) -> tuple[list, Arrivals]:
        """Submit ``sequences[i]`` (token ids) with ``params[i]`` (SamplingParams, set to FINAL_ONLY here) at
        ``i * gap_s`` seconds; ``progress(done, total)`` after each final output. Returns the final RequestOutputs
        in request order, and how they arrived."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.calls += 1
        total, done_count = len(sequences), 0
        sent, done = [0.0] * total, [0.0] * total

        async def one(i: int):
            nonlocal done_count
            await asyncio.sleep(i * gap_s)
            sent[i] = time.perf_counter() - start
            params[i].output_kind = RequestOutputKind.FINAL_ONLY
            final = None
            async for output in self.engine.generate(
                TokensPrompt(prompt_token_ids=list(sequences[i])), params[i], request_id=f"alignaudit-{self.calls}-{i}"
            ):
                final = output
            done[i] = time.perf_counter() - start
            done_count += 1
            progress(done_count, total)
            return final

        async def run():
            return await asyncio.gather(*(one(i) for i in range(total)))

        start = time.perf_counter()
        outputs = self.loop.run_until_complete(run())
        return outputs, Arrivals.of(gap_s, sent, done)

    def close(self) -> None:
        """Shut the engine down inside its loop: from outside, vLLM only schedules the closing of its ZMQ sockets on
        the loop (BackgroundResources, vllm/v1/engine/core_client.py), and a socket left open makes the ZMQ context's
        garbage collection block forever (seen: a worker hung in zmq Context.term)."""

        async def stop():
            self.engine.shutdown()
            await asyncio.sleep(0)  # let the cancelled output tasks finish

        self.loop.run_until_complete(stop())
        self.loop.close()
