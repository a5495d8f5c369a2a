"""vLLM engine: the offline ``LLM`` API with token-id prompts, as an RL rollout worker uses it; rollouts of
``engine_mode="async"`` go through ``AsyncLLM`` instead (async_rollout.py).

Logprobs: vLLM's ``prompt_logprobs`` (0 alternatives, so each entry holds the prompt token itself), under
the engine's logprobs mode (default ``raw_logprobs``: log_softmax of the raw logits in fp32,
vllm/v1/sample/sampler.py). vLLM returns them as Python floats converted exactly from fp32.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that hooks and strict kernels
can reach the model; alignaudit already gives vLLM a process of its own.

Options: any vllm EngineArgs field (``enforce_eager``, ``enable_prefix_caching``, ``max_num_seqs``,
``max_num_batched_tokens``, ``logprobs_mode``, ...) goes to ``LLM(...)``; any SamplingParams field goes to
the sampling parameters. The KV cache is bounded to what the prompts need, and at least one max_model_len
sequence (``kv_cache_bytes``), unless ``kv_cache_memory_bytes`` or ``gpu_memory_utilization`` is given (the CPU
backend otherwise reserves most of the machine's memory).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from alignaudit.engines.base import Engine, first_lines, int_option, reject_unknown, reject_wrong_types
from alignaudit.errors import EngineError, InputError
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import EngineSettings

if TYPE_CHECKING:
    from vllm import LLM

    from alignaudit.engines.vllm.async_rollout import Arrivals, AsyncRollout

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_VLLM_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class VllmEngine(Engine):
    name = "vllm"

    @staticmethod
    def _engine_fields() -> dict[str, object]:
        import dataclasses

        from vllm import EngineArgs

        return {f.name: f.type for f in dataclasses.fields(EngineArgs)}

    @classmethod
    def check_options(cls, options):
        import typing

        from vllm import SamplingParams

        try:
            hints = typing.get_type_hints(SamplingParams)
        except (NameError, TypeError):  # an annotation this vLLM cannot resolve: check names only
            hints = {}
        fields = {**{name: hints.get(name) for name in SamplingParams.__struct_fields__}, **cls._engine_fields()}
        reject_unknown(
            "vllm", options, set(fields), "vllm accepts EngineArgs and SamplingParams fields (see `vllm serve --help`)"
        )
        reject_wrong_types("vllm", options, fields)

    @classmethod
    def check_config(cls, spec, settings, role, mode):
        from vllm import SamplingParams

        from alignaudit.engines.vllm.options import check_sampling_params, check_vllm_sampling

        fields = set(cls._engine_fields())
        check_vllm_sampling(settings.options, fields, mode, role)
        check_sampling_params(SamplingParams, settings.options, fields, role)

    def __init__(self, spec: ModelSpec, settings: EngineSettings):
        super().__init__(spec, settings)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from alignaudit.engines.base import require_flash
        from alignaudit.inputs.strict_ops import ATTENTION_ENV, ENV, EXP_ENV, format_strict

        require_flash(settings, spec)
        os.environ[ENV] = format_strict(settings.strict_ops)  # read by the plugin in every vLLM process
        os.environ[EXP_ENV] = settings.strict_exp  # read by the strict attention backend
        os.environ[ATTENTION_ENV] = settings.strict_attention  # read by the strict attention backend too
        self.tp_size = int(settings.options.get("tensor_parallel_size", 1))
        if settings.device == "cpu" and self.tp_size > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            # vLLM's automatic binding wants one NUMA node per rank (vllm/utils/ompmultiprocessing.py); split
            # this process's cores into one list per rank instead.
            cores = sorted(os.sched_getaffinity(0))
            per = len(cores) // self.tp_size
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in cores[r * per : (r + 1) * per]) for r in range(self.tp_size)
            )
        engine_fields = self._engine_fields()
        self.engine_options = {k: v for k, v in settings.options.items() if k in engine_fields}
        self.sampling_options = {k: v for k, v in settings.options.items() if k not in engine_fields}
        self.llm: LLM | AsyncRollout | None = None  # built by the first call (_start)
        self.llm_kwargs: dict = {}
        self.attention_impls: dict[str, str | None] = {}  # impl class -> strict exp, read back from the model
        self.attention_kernels: list[str] = []  # the strict attention kernels, read back from the model
        self.linear_methods: list[str] = []  # quant_method classes of the linear layers, read back from the model
        self.plugin_ops: list[str] = []  # the ops the strict plugin patched in the process holding the model
        self.capture_overrides: dict = {}  # settings op capture changed against the ones asked for
        # LLM(...) start, warm-up included; it happens in the first call, sized to its prompts
        self.startup_s: float | None = None
        # prompt tokens read from the prefix cache in the last rollout (vLLM's count)
        self.prefix_cache_hits: int | None = None
        self.engine_mode = "offline"  # set by the first rollout's Sampling; "async": self.llm is an AsyncRollout
        self.arrivals: Arrivals | None = None  # async mode: how the last rollout's requests arrived
        self.arrival_gap_s = 0.0  # async mode: seconds between two arrivals (Sampling.arrival_gap_s)

    @classmethod
    def prepare_for_weight_updates(cls) -> None:
        """vLLM's CPU backend frees linear weights once it has packed them: keep them (weights.py)."""
        from alignaudit.engines.vllm.weights import keep_vllm_cpu_weights
        from alignaudit.engines.vllm.worker_extension import KEEP_WEIGHTS_ENV

        keep_vllm_cpu_weights()
        os.environ[KEEP_WEIGHTS_ENV] = "1"  # and in vLLM's engine process, in async mode (worker_extension)

    def start(self, max_len: int, total_tokens: int, max_seqs: int | None = None, engine_mode: str = "offline") -> None:
        """Build the LLM (``engine_mode`` "async": an AsyncLLM) once, sized for the longest sequence and the whole
        batch (later calls: no-op).
        ``max_seqs``: the most sequences one call will run (rl's rollout batch); on CUDA it becomes vLLM's
        ``max_num_seqs`` unless given as an engine option, so vLLM captures CUDA graphs for the batch sizes
        it can meet (up to twice it) instead of up to 512: at the Qwen3-1.7B shape 51 sizes x 2 modes took
        33 s of a 72 s start for a batch of 32 (H200, 2026-12-01). Every sequence still runs in one batch."""
        if self.llm is None:
            self.engine_mode = engine_mode
        self._start(max_len, total_tokens, max_seqs)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """New weights (HF names) into the running engine, as RL frameworks push them (weights.py)."""
        from alignaudit.engines.vllm.weights import load_into_vllm

        self._in_process("a weight update")
        load_into_vllm(self._offline(), tensors)

    def sync_weights(self, transport: str, path: str | None = None, handles: str | None = None) -> dict:
        """Engine.sync_weights; in async mode inside vLLM's worker process, where the model lives
        (worker_extension.KernelReadback.alignaudit_sync_weights), then the prefix cache dropped as after a load."""
        if self.engine_mode != "async":
            return super().sync_weights(transport, path, handles)
        engine = self._async()
        reply = engine.rpc("alignaudit_sync_weights", transport, path, handles, self.spec.to_dict())
        engine.reset_prefix_cache()
        return reply

    def weight_checksums(self) -> dict[str, str]:
        """Engine.weight_checksums; in async mode computed in vLLM's worker process."""
        if self.engine_mode != "async":
            return super().weight_checksums()
        return self._async().rpc("alignaudit_checksums", self.spec.to_dict())

    def stale_packed_layers(self) -> list[str]:
        """Layers whose packed CPU GEMM does not compute with their current weight (weights.py)."""
        from alignaudit.engines.vllm.weights import stale_packed_layers

        return stale_packed_layers(self._offline().apply_model(lambda m: m)[0])

    def hf_weights(self, diverged: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The weights the running engine computes with, in HF names."""
        from alignaudit.engines.vllm.weights import vllm_to_hf

        return vllm_to_hf(self._offline().apply_model(lambda m: m)[0], self.spec)

    def _started(self) -> LLM | AsyncRollout:
        """The engine _start built. Raises EngineError before it."""
        if self.llm is None:
            raise EngineError("vLLM's engine is not started yet (it starts with the first call that runs prompts)")
        return self.llm

    def _offline(self) -> LLM:
        """The offline ``LLM`` (engine_mode "offline"), whose model is in this process. Raises EngineError before it
        is started or in async mode."""
        from vllm import LLM

        engine = self._started()
        if not isinstance(engine, LLM):
            raise EngineError(f"this vLLM engine runs {self.engine_mode}, not offline: its model is in another process")
        return engine

    def _async(self) -> AsyncRollout:
        """The ``AsyncRollout`` of engine_mode "async". Raises EngineError before it is started or in offline mode."""
        from alignaudit.engines.vllm.async_rollout import AsyncRollout

        engine = self._started()
        if not isinstance(engine, AsyncRollout):
            raise EngineError(f"this vLLM engine runs {self.engine_mode}, not async")
        return engine

    def _in_process(self, what: str) -> None:
        """Raises InputError in async mode, whose model lives in vLLM's engine process, out of this one's reach."""
        if self.engine_mode == "async":
            raise InputError(
                f"{what} reaches vLLM's model in this process; in --engine-mode async it runs in vLLM's "
                "engine process (not built yet); use --engine-mode offline"
            )

    def _start(self, max_len: int, total_tokens: int, max_seqs: int | None = None) -> None:
        """Build the LLM once, sized for the longest sequence and the whole batch."""
        if self.llm is not None:
            return
        from vllm import LLM

        spec = self.spec
        max_model_len = model_len(spec, max_len)
        kwargs: dict[str, Any] = {
            "model": spec.path,
            "dtype": _VLLM_DTYPE[self.settings.dtype],
            "seed": self.settings.seed,
            "max_model_len": max_model_len,
            "skip_tokenizer_init": not spec.has_tokenizer,
        }
        if not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(self.engine_options):
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(
                spec, self.settings.dtype, total_tokens, max_len, self.engine_options
            )
            if self.settings.device == "cuda":
                # vLLM starts only if gpu_memory_utilization x the GPU's memory is free (request_memory,
                # vllm/v1/worker/utils.py); with the KV cache sized above, that check is all it is used for. rl's
                # trainer shares the GPU: ask for most of what is free now rather than 0.9 of the card.
                free, total = torch.cuda.mem_get_info()
                kwargs["gpu_memory_utilization"] = round(min(0.9, 0.95 * free / total), 3)
        if max_seqs and self.settings.device == "cuda" and "max_num_seqs" not in self.engine_options:
            kwargs["max_num_seqs"] = max_seqs
        if (
            self.settings.strict_ops
            and self.settings.device == "cpu"
            and "max_num_batched_tokens" not in self.engine_options
        ):
            # Compiled vLLM warms up with a forward of max_num_batched_tokens tokens; the strict CPU kernels
            # spell every reduction out and take minutes for that on a real-shape model. Strict results do
            # not depend on how tokens are batched, so a batch budget of what the prompts need changes no bit.
            kwargs["max_num_batched_tokens"] = max(256, -(-total_tokens // 64) * 64)
        if self.tap is not None:
            # Hooks need every prompt row computed (a prefix-cache hit skips rows) and eager mode (torch.compile
            # would trace them away), except the strict MoE layer's router and routing: alignaudit::moe_route is
            # an opaque op that runs eagerly inside a compiled model and reports them, so capturing only those
            # keeps the engine as it is (compiled by default). vLLM's own compiled MoE exposes no routing.
            # What this changes against the configuration asked for is recorded (capture_overrides): bisect
            # then runs the engine as configured too and says where the two differ.
            kwargs["enable_prefix_caching"] = False
            if not (_read_only(self.tap) and "linear" in self.settings.strict_ops):
                if self.engine_options.get("enforce_eager") is False:
                    raise InputError("op capture needs vLLM's eager mode; drop enforce_eager=false")
                kwargs["enforce_eager"] = True
            self.capture_overrides = {
                k: kwargs[k]
                for k in ("enable_prefix_caching", "enforce_eager")
                if k in kwargs and k not in self.engine_options
            }
        kwargs.update(self.engine_options)
        if self.settings.lm_head_dtype == "fp32":  # vLLM's own switch (ModelConfig.head_dtype)
            kwargs["hf_overrides"] = {**(kwargs.get("hf_overrides") or {}), "head_dtype": "float32"}
        self.llm_kwargs = kwargs
        if self.settings.strict_ops:
            from alignaudit.engines.vllm import plugin as vllm_plugin
            from alignaudit.inputs.strict_ops import prefer_runner_v1

            vllm_plugin.register()  # also loaded through the entry point; registering twice is a no-op
            if "logprobs" in self.settings.strict_ops and kwargs.get("logprobs_mode") in vllm_plugin.PROCESSED_MODES:
                # vllm options refuse V2 asked for; vLLM 0.26 on CUDA otherwise picks V2 for some models
                prefer_runner_v1()
        started = time.perf_counter()
        try:
            if self.engine_mode == "async":
                from alignaudit.engines.vllm.async_rollout import AsyncRollout

                rollout = AsyncRollout(kwargs)
                self.llm, self.llm_kwargs = rollout, rollout.kwargs
            else:
                self.llm = LLM(**kwargs)
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            raise InputError(f"vLLM rejected the engine settings: {first_lines(e)}") from e
        self.startup_s = round(time.perf_counter() - started, 3)
        self._check_kernels()

    def _check_kernels(self) -> None:
        """Read back, in the process holding the model, which ops the strict plugin patched there and which
        attention implementation and linear method every layer computes with; a strict op not patched, or strict
        attention (linear) asked for and a layer on another one (vLLM selected a backend the plugin does not
        replace, or a quantized method), is an error (weights.check_strict_kernels)."""
        from alignaudit.engines.vllm.weights import check_strict_kernels, kernels_of

        kernels = self._async().kernels() if self.engine_mode == "async" else self._offline().apply_model(kernels_of)[0]
        self.attention_impls, self.linear_methods = kernels["attention_impls"], kernels["linear_methods"]
        self.attention_kernels = kernels["attention_kernels"]
        self.plugin_ops = kernels["strict_ops"]
        check_strict_kernels(kernels, self.settings.strict_ops, self.settings.strict_attention)

    def _progress_bar(self):
        """A ``use_tqdm`` callable for ``LLM.generate`` that reports finished requests as progress lines."""
        import tqdm

        engine = self

        class Progress(tqdm.tqdm):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "file": open(os.devnull, "w")})  # noqa: SIM115 (the bar's life)

            def update(self, n=1):
                result = super().update(n)
                engine.progress(self.n, self.total)
                return result

        return Progress

    def _generate(self, batch: TokenBatch, params):
        from vllm.inputs import TokensPrompt

        if self.engine_mode == "async":
            outputs, self.arrivals = self._async().generate(batch.sequences, params, self.arrival_gap_s, self.progress)
            return outputs
        return self._offline().generate(
            [TokensPrompt(prompt_token_ids=list(s)) for s in batch.sequences], params, use_tqdm=self._progress_bar()
        )

    @torch.no_grad()
    def rollout(self, batch, sampling):
        """vLLM samples up to ``sampling.max_new_tokens`` per completion, ``sampling.group_size`` completions per
        prompt as one request (``n``), EOS ignored (``ignore_eos``: EOS neither stops nor is masked; ``min_tokens``
        would mask it) unless ``sampling.stop_at_eos``, and records each sampled token's logprob; the prompt's too
        (teacher-forced) unless ``sampling.prompt_logprobs`` is False, when those positions are NaN and vLLM reads
        its prefix cache (``prefix_cache_hits``: the cached prompt tokens vLLM reported, read back). With
        ``vocab_sink`` set (rl --full-vocab), ``vocab_sink(i, rows)`` gets request i's sampler rows, float32
        [max_new_tokens, V], row j the one its j-th sampled token's logprob was gathered from (vocab.DecodeRows).

        Returns the sequences (prompt 0's completions, then prompt 1's, ...) and their logprobs [len - 1]."""
        from vllm import SamplingParams

        group = sampling.group_size
        if group != 1 and self.vocab_sink is not None:
            raise InputError("full-vocabulary rows of grouped rollouts are not built yet; drop --group-size")
        if self.llm is not None and sampling.engine_mode != self.engine_mode:
            raise InputError(
                f"this vLLM engine runs {self.engine_mode}; a rollout of engine_mode "
                f"{sampling.engine_mode} needs another engine"
            )
        if sampling.engine_mode == "async" and self.vocab_sink is not None:
            raise InputError(
                "full-vocabulary rows of async rollouts are not built (the sampler runs in vLLM's engine "
                "process); drop --engine-mode async"
            )
        self.engine_mode = sampling.engine_mode
        if self.engine_mode == "async":
            self.arrival_gap_s = sampling.arrival_gap_s
        self._start(
            max(len(s) for s in batch.sequences) + sampling.max_new_tokens,
            group * (batch.num_tokens + len(batch.sequences) * sampling.max_new_tokens),
        )
        params = [
            SamplingParams(
                **{
                    **self.sampling_options,
                    "max_tokens": sampling.max_new_tokens,
                    "n": group,
                    "ignore_eos": not sampling.stop_at_eos,
                    "temperature": sampling.temperature,
                    "top_k": sampling.top_k,
                    "top_p": sampling.top_p,
                    "seed": sampling.seed + i,
                    "logprobs": 0,
                    "prompt_logprobs": 0 if sampling.prompt_logprobs else None,
                    "detokenize": False,
                }
            )
            for i in range(len(batch.sequences))
        ]
        rows = None
        if self.vocab_sink is not None:
            from alignaudit.engines.vllm.vocab import DecodeRows

            rows = DecodeRows(self._offline().collective_rpc(lambda worker: worker.model_runner)[0])
        try:
            outputs = self._generate(batch, params)
        finally:
            if rows is not None:
                rows.hooks.close()
        sequences, logprobs, self.prefix_cache_hits = [], [], 0
        for i, (out, prompt) in enumerate(zip(outputs, batch.sequences, strict=True)):
            if len(out.outputs) != group:
                raise EngineError(f"vLLM returned {len(out.outputs)} completions for prompt {i}, not {group}")
            self.prefix_cache_hits += int(out.num_cached_tokens or 0)
            prompt_lp = (
                [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
                if sampling.prompt_logprobs
                else [float("nan")] * (len(prompt) - 1)
            )
            for done in out.outputs:
                generated = list(done.token_ids)
                if rows is not None:
                    self.vocab_sink(i, rows.take(out.request_id, len(generated)))
                sampled_lp = [e[t].logprob for e, t in zip(done.logprobs, generated, strict=True)]
                sequences.append(tuple(prompt) + tuple(generated))
                logprobs.append(torch.tensor(prompt_lp + sampled_lp, dtype=torch.float32))
        texts = tuple(t for t in batch.texts for _ in range(group))
        return TokenBatch(tuple(sequences), texts, batch.source), logprobs

    @torch.no_grad()
    def prompt_logprobs(self, batch: TokenBatch) -> list[torch.Tensor]:
        from vllm import SamplingParams

        self._start(max(len(s) for s in batch.sequences) + 1, batch.num_tokens + len(batch.sequences))
        if self.tap is not None and self.hooks is None:
            from alignaudit.engines.vllm import taps as vllm_taps

            model = self._offline().apply_model(lambda m: m)[0]
            self.hooks = vllm_taps.install(model, self.tap, batch.sequences)
        params = SamplingParams(
            **{"max_tokens": 1, "temperature": 0.0, "detokenize": False, **self.sampling_options, "prompt_logprobs": 0}
        )
        rows = None
        if self.vocab_sink is not None:
            from alignaudit.engines.vllm.vocab import PromptRows

            rows = PromptRows(self._offline().apply_model(lambda m: m)[0], batch.sequences)
        try:
            outputs = self._generate(batch, params)
        finally:
            if rows is not None:
                rows.hooks.close()
        if rows is not None:
            rows.finish(self.vocab_sink)
        results = []
        for out, seq in zip(outputs, batch.sequences, strict=True):
            entries = out.prompt_logprobs[1:]  # position 0 has no logprob
            results.append(
                torch.tensor([e[t].logprob for e, t in zip(entries, seq[1:], strict=True)], dtype=torch.float32)
            )
        return results

    def sleep(self, level: int) -> dict:
        """vLLM's sleep mode (``LLM.sleep``; the engine must have been built with ``enable_sleep_mode``): level 1
        moves the weights to host memory and discards the KV cache (and with it the prefix cache). Returns
        ``{"freed_bytes": device memory free after minus before (torch.cuda.mem_get_info), "seconds"}``: what
        sleeping gave back, measured."""
        engine = self._started()
        return self._measured(lambda: engine.sleep(level=level), sign=1)

    def wake_up(self) -> dict:
        """``LLM.wake_up()``: weights back on the device, the KV cache reallocated. Returns ``{"taken_bytes",
        "seconds"}`` as sleep does."""
        return self._measured(self._started().wake_up, sign=-1)

    def _measured(self, action, sign: int) -> dict:
        torch.cuda.synchronize()
        before, started = torch.cuda.mem_get_info()[0], time.perf_counter()
        action()
        torch.cuda.synchronize()
        change = sign * (torch.cuda.mem_get_info()[0] - before)
        return {
            "freed_bytes" if sign > 0 else "taken_bytes": change,
            "seconds": round(time.perf_counter() - started, 3),
        }

    def close(self) -> None:
        """Remove hooks; an async engine's core process is shut down."""
        super().close()
        if self.engine_mode == "async" and self.llm is not None:
            self._async().close()
            self.llm = None

    def vocab_row_formula(self) -> str:
        from alignaudit.engines.vllm.vocab import formula

        return formula("logprobs" in self.settings.strict_ops)

    def install_taps(self, tap):
        return None  # installed once the LLM exists and the prompts are known (prompt_logprobs)

    def settings_record(self) -> dict:
        exps = sorted({exp for exp in self.attention_impls.values() if exp})
        record = {
            "llm": dict(self.llm_kwargs),
            "sampling": dict(self.sampling_options),
            "strict": self.settings.strict,
            "attention_exp": ",".join(exps) or None,
            "attention_impl": sorted(self.attention_impls),
            "attention_kernel": ",".join(self.attention_kernels) or None,
            "linear_methods": list(self.linear_methods),
            "plugin_ops": list(self.plugin_ops),
            "capture_overrides": dict(self.capture_overrides),
            "prefix_cache_hits": self.prefix_cache_hits,
            "engine_mode": self.engine_mode,
            "arrivals": self.arrivals.to_dict() if self.arrivals else None,
        }
        if self.llm is not None:
            config = (
                self._async().vllm_config if self.engine_mode == "async" else self._offline().llm_engine.vllm_config
            )
            record["resolved"] = {
                "enforce_eager": config.model_config.enforce_eager,
                "compilation_mode": str(getattr(config.compilation_config, "mode", None)),
                "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
                "cudagraph_capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
                "model_runner_v2": bool(getattr(config, "use_v2_model_runner", False)),
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "block_size": config.cache_config.block_size,  # prefix-cache hits come in whole blocks
                "max_model_len": config.model_config.max_model_len,
                "kv_cache_tokens": _kv_cache_tokens(config.cache_config),
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "logprobs_mode": str(config.model_config.logprobs_mode),
                "head_dtype": str(config.model_config.head_dtype),
                "quantization": config.model_config.quantization,
                "kv_cache_dtype": str(config.cache_config.cache_dtype),
                "attention_backend": os.environ.get("VLLM_ATTENTION_BACKEND"),
                "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                "cpu_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "device": str(config.device_config.device),
                "startup_s": self.startup_s,
            }
        return record


def model_len(spec: ModelSpec, max_len: int) -> int:
    """vLLM's max_model_len for sequences of up to ``max_len`` tokens: the next power of two, at least 1024,
    at most the model's max_position_embeddings."""
    return min(spec.max_position_embeddings, max(1024, 1 << (max_len - 1).bit_length()))


def kv_cache_bytes(spec: ModelSpec, dtype: str, total_tokens: int, max_len: int, options: dict) -> int:
    """The KV cache alignaudit gives vLLM (bytes): K and V of every layer in ``dtype`` for twice the larger of
    ``total_tokens`` tokens (the whole batch) and one sequence of max_model_len tokens, at least 16 MiB.

    max_model_len is the user's ``options["max_model_len"]`` (--infer-opt; the option check has refused any value that
    is not an integer before an engine starts) or else ``model_len(spec, max_len)``. vLLM refuses to start with less
    KV cache than one such sequence needs (``_check_enough_kv_cache_memory``, vllm/v1/core/kv_cache_utils.py): on an
    H100 (2026-12-06) Qwen3-8B at max_model_len 32768 got the batch's 0.32 GiB and vLLM asked for 4.5 GiB. A value
    below 1 (vLLM: fit to memory) leaves the batch's size.

    Raises:
        InputError: a max_model_len option that is not an integer.
    """
    max_model_len = int_option(options, "max_model_len", model_len(spec, max_len), minimum=-1)
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * _BYTES[dtype]
    return max(16 << 20, 2 * per_token * max(total_tokens, max_model_len))


def _kv_cache_tokens(cache_config) -> int | None:
    """How many tokens the KV cache vLLM allocated holds: vLLM's ``kv_cache_size_tokens`` where it has it (0.32:
    group-aware, right for hybrid models too, vllm/config/cache.py), else its blocks times the block size; None
    before vLLM has sized it (e.g. where the engine core runs in another process)."""
    tokens = getattr(cache_config, "kv_cache_size_tokens", None)
    if tokens:
        return int(tokens)
    blocks = getattr(cache_config, "num_gpu_blocks", None)  # vLLM's name on every device, the CPU's too
    return blocks * cache_config.block_size if blocks else None


def _read_only(tap) -> bool:
    """Whether ``tap`` only reads ops no engine lets a hook replace (OpDef.replaceable: router, routing), in
    natural mode."""
    from alignaudit.capture.ops import OP_DEFS

    names = tap.selection.names
    return (
        tap.reference is None
        and names is not None
        and not tap.selection.extra
        and all(not OP_DEFS[n].replaceable for n in names)
    )
