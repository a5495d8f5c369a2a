"""Full-vocabulary rows from vLLM's prompt-logprob path (``compare --full-vocab``).

vLLM computes prompt logprobs per request (GPUModelRunner._get_prompt_logprobs_dict, vllm/v1/worker/
gpu_model_runner.py, which the CPU runner inherits): ``logits = model.compute_logits(hidden_states[rows of the
request])``, then ``Sampler.compute_logprobs(logits)`` (vllm/v1/sample/sampler.py: ``logits.log_softmax(dim=-1,
dtype=torch.float32)``; the strict plugin replaces it with alignaudit_kernels.log_softmax), then a gather at the
prompt's next tokens. A hook on ``logits_processor`` (which compute_logits calls) sees those logits, row slices of
the model output as the op taps read them (taps.StepRows, taps._slice_spans), and hands them to the same
``Sampler.compute_logprobs`` (looked up at call time, so strict runs get the strict kernel): each row is the
whole row vLLM gathers its prompt logprob from. The sampling call (rows gathered, not sliced) is left alone.
The model is not changed: the hooks sit on the outer ``*ForCausalLM`` and its logits processor, outside the
compiled graph, so compiled and eager engines give their own rows. Prefix caching cannot skip rows: vLLM does not
read the prefix cache for a request that asks for prompt logprobs (SamplingParams.skip_reading_prefix_cache).
Rows are kept on the host until the batch is done (tensor-parallel ranks run in processes of vLLM's own, which
these hooks do not reach: checks.check_full_vocab refuses tensor_parallel_size > 1).

``DecodeRows`` (``rl --full-vocab``): the rows vLLM's sampler computes while it decodes. Every sampled token comes
out of one ``Sampler.forward(logits, sampling_metadata)`` call of the model runner (GPUModelRunner._sample, which
the CPU runner inherits), whose first step under ``logprobs_mode=raw_logprobs`` is ``raw_logprobs =
self.compute_logprobs(logits)`` and whose recorded logprob is that row's gather at the sampled token
(Sampler.gather_logprobs). A forward pre-hook and hook on the runner's sampler module bracket each call; inside
it, the sampler instance's ``compute_logprobs`` is vLLM's own (the class's, looked up at call time, so strict runs
get the strict plugin's kernel) with its result kept. Row i of a call is request ``input_batch.req_ids[i]``; rows
of requests whose sampled token vLLM discards (a chunked prefill not yet done: ``discard_request_mask``) are
dropped. The prompt-logprob path calls ``compute_logprobs`` outside ``forward`` and is not seen.
"""

from __future__ import annotations

import torch

from alignaudit.engines.taps import Hooks
from alignaudit.engines.vllm.taps import StepRows, _slice_spans
from alignaudit.errors import EngineError


def formula(strict_logprobs: bool) -> str:
    """How the rows were computed, in words (the manifest's ``vocab.rows``)."""
    how = (
        "alignaudit_kernels.log_softmax (the strict plugin's Sampler.compute_logprobs)"
        if strict_logprobs
        else "vllm.v1.sample.sampler.Sampler.compute_logprobs: logits.log_softmax(dim=-1, dtype=float32)"
    )
    return f"{how} of the logits compute_logits returns for the prompt-logprob rows"


class PromptRows:
    """Collects each sequence's rows while ``LLM.generate`` scores the prompts; ``finish`` hands them out."""

    def __init__(self, model, sequences: tuple[tuple[int, ...], ...]):
        from vllm.v1.sample.sampler import Sampler

        self.sequences = sequences
        self.pieces: dict[int, dict[int, torch.Tensor]] = {}
        self.hooks = Hooks()
        step_rows = StepRows(sequences)
        state: dict = {"spans": [], "base": None}

        def begin_step(module, args, kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            state["spans"] = step_rows.spans(input_ids, positions)

        def end_step(module, args, kwargs, output):
            state["base"] = output

        def logits(module, args, output):
            spans = _slice_spans(state["spans"], state["base"], args[1])
            if spans:
                rows = Sampler.compute_logprobs(output)  # vLLM's own, as the prompt-logprob path calls it next
                for s in spans:
                    piece = rows[s.row_start : s.row_start + s.length].to("cpu", copy=True)
                    self.pieces.setdefault(s.seq, {})[s.pos_start] = piece
            return None

        self.hooks.raw(model, begin_step, pre=True, with_kwargs=True)
        self.hooks.raw(model, end_step, with_kwargs=True)
        self.hooks.raw(model.logits_processor, logits)

    def finish(self, sink) -> None:
        """Remove the hooks and give ``sink(seq, rows)`` each sequence's rows, float32 [len - 1, V], in order.
        Raises RuntimeError when the rows seen do not cover positions 0 .. len - 2 of every sequence once."""
        self.hooks.close()
        for seq, tokens in enumerate(self.sequences):
            pieces = self.pieces.get(seq, {})
            starts = sorted(pieces)
            rows = torch.cat([pieces[p] for p in starts]) if starts else torch.empty(0)
            covered = [p for start in starts for p in range(start, start + len(pieces[start]))]
            if covered != list(range(len(tokens) - 1)):
                raise RuntimeError(
                    f"full-vocabulary rows of sequence {seq}: vLLM's prompt-logprob logits covered "
                    f"positions {covered[:3]}..., expected 0..{len(tokens) - 2}"
                )
            sink(seq, rows)


class DecodeRows:
    """Collects, while ``LLM.generate`` decodes, the sampler's full log-softmax row of every sampled token.

    Args:
        runner: vLLM's (V1) model runner in this process (``collective_rpc(lambda w: w.model_runner)``).
    Raises:
        EngineError: the runner is not one whose sampler this hooks (model runner V2, speculative decoding).
    """

    def __init__(self, runner):
        sampler = getattr(runner, "sampler", None)
        if (
            sampler is None
            or not hasattr(runner, "input_batch")
            or not hasattr(runner, "discard_request_mask")
            or getattr(runner, "speculative_config", None) is not None
        ):
            raise EngineError(
                "rl --full-vocab reads vLLM's V1 model runner's sampler while it decodes; this engine "
                "runs another one (model runner V2 or speculative decoding): unset "
                "VLLM_USE_V2_MODEL_RUNNER / drop speculative_config, or drop --full-vocab"
            )
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.hooks = Hooks()
        state: dict = {"inside": False, "rows": []}
        owner = type(sampler)

        def compute_logprobs(logits):
            rows = owner.compute_logprobs(logits)  # vLLM's (or the strict plugin's), as forward calls it
            if state["inside"]:
                state["rows"].append(rows)
            return rows

        def begin(module, args, kwargs):
            state["inside"], state["rows"] = True, []

        def end(module, args, kwargs, output):
            state["inside"] = False
            if not state["rows"]:
                return None  # no logprobs asked for in this call
            if len(state["rows"]) != 1:
                raise EngineError(
                    f"rl --full-vocab: vLLM's sampler computed logprobs {len(state['rows'])} times in "
                    "one call, expected once"
                )
            rows = state["rows"][0]
            n = rows.shape[0]
            discard = runner.discard_request_mask.np[:n]
            for i, req_id in enumerate(runner.input_batch.req_ids[:n]):
                if not discard[i]:
                    self.rows.setdefault(req_id, []).append(rows[i].to("cpu", copy=True))
            return None

        sampler.compute_logprobs = compute_logprobs  # an instance attribute over the class's staticmethod
        self.hooks.defer(lambda: sampler.__dict__.pop("compute_logprobs", None))
        self.hooks.raw(sampler, begin, pre=True, with_kwargs=True)
        self.hooks.raw(sampler, end, with_kwargs=True)

    def take(self, request_id: str, count: int) -> torch.Tensor:
        """The rows of request ``request_id`` (the external id ``LLM.generate`` returns; vLLM's internal id adds a
        ``-suffix``), float32 [count, V] in decode order. Raises EngineError when it did not get ``count`` rows."""
        found = [k for k in self.rows if k == request_id or k.rsplit("-", 1)[0] == request_id]
        pieces = self.rows[found[0]] if len(found) == 1 else []
        if len(pieces) != count:
            raise EngineError(
                f"rl --full-vocab: vLLM's sampler gave request {request_id} {len(pieces)} rows for "
                f"{count} sampled tokens"
            )
        return torch.stack(pieces)
