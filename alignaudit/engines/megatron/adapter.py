"""Megatron-Core engine: GPTModel with the local layer spec, as a Megatron trainer builds it.

Model: RMSNorm (torch.nn.RMSNorm through WrappedTorchNorm), SwiGLU, GQA, QK-norm, RoPE, no biases,
dropout off; weights converted from the HF checkpoint (weights.py). In bf16/fp16 the model is
wrapped in megatron.core's Float16Module, as megatron-lm's training loop wraps it.

Logprobs: ``-loss`` where loss is GPTModel's own per-token training loss with ``labels`` given, i.e.
``tensor_parallel.vocab_parallel_cross_entropy`` on the output logits (upcast to fp32 inside):
``log(sum(exp(l - max))) - (l[target] - max)`` (megatron/core/tensor_parallel/cross_entropy.py). RL
trainers on Megatron (verl, NeMo-RL) take logprobs from the same function.

Runs at tensor-parallel size ``tensor_model_parallel_size`` (default 1; pipeline parallel size 1), one
process per rank started by the worker (workers/capture_worker.py): gloo on CPU, NCCL on CUDA. Weights are sharded
per rank as Megatron shards them (weights.tp_shard); every rank computes the same logprobs, rank 0
writes them.

Options: ``micro_batch_size`` (sequences per forward, right-padded; default 1) and any TransformerConfig
field (e.g. ``attention_softmax_in_fp32=false``, ``apply_rope_fusion=true``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile

import torch

from alignaudit.engines.base import (
    Engine,
    applied_exp,
    applied_kernel,
    first_lines,
    fp32_head,
    micro_batch_option,
    reject_unknown,
    reject_wrong_types,
    require_flash,
    right_padded,
)
from alignaudit.engines.megatron.options import MEGATRON_CHECKPOINT_FIELDS
from alignaudit.engines.megatron.weights import megatron_state_dict
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import EngineSettings

RANK_ENV, WORLD_ENV, RENDEZVOUS_ENV = "RANK", "WORLD_SIZE", "ALIGNAUDIT_RENDEZVOUS"


def tensor_parallel_size(settings: EngineSettings) -> int:
    """The run's tensor-parallel size (the ``tensor_model_parallel_size`` option; 1 without it)."""
    return int(settings.options.get("tensor_model_parallel_size", 1))


def init_parallel(device: str, tp: int) -> int:
    """Process group, Megatron parallel state (tensor parallel ``tp``, pipeline 1) and RNG tracker for this
    rank (idempotent); returns the rank. Rank and rendezvous come from RANK and ALIGNAUDIT_RENDEZVOUS (set
    by the worker that starts the ranks), else rank 0 of 1. Gloo on CPU, NCCL on CUDA (one GPU per rank)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed

    rank = int(os.environ.get(RANK_ENV, 0))
    if device == "cuda":
        torch.cuda.set_device(rank)
    if not torch.distributed.is_initialized():
        rendezvous = os.environ.get(RENDEZVOUS_ENV) or rendezvous_file()
        torch.distributed.init_process_group(
            "nccl" if device == "cuda" else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=tp
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    if device == "cuda":
        model_parallel_cuda_manual_seed(0)
    else:
        initialize_rng_tracker(inference_rng_tracker=True)  # the CUDA RNG tracker needs a GPU
        # Rotary inv_freq and the attention score buffer are allocated on torch.cuda.current_device();
        # on a CPU-only worker point them at the CPU (this process runs nothing else).
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # a device, not an index
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.19 imports te_general_gemm from Transformer Engine inside a try, then tests it for None in
    # the MoE router's linear (moe_utils.RouterGatingLinearFunction): without TE the name is unbound.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return rank


def transformer_config(spec: ModelSpec, settings: EngineSettings, overrides: dict):
    """The TransformerConfig for ``spec``; ``overrides`` are TransformerConfig fields from the user."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = settings.torch_dtype
    fields = {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_query_groups": spec.num_query_groups,
        "kv_channels": spec.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": spec.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": spec.attention_bias,
        "qk_layernorm": spec.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "use_cpu_initialization": settings.device == "cpu",
        "perform_initialization": False,  # every weight is loaded from the checkpoint
    }
    if spec.num_experts:  # Qwen3 MoE: softmax top-k routing, no aux loss at inference, one rank
        fields.update(
            {
                "num_moe_experts": spec.num_experts,
                "moe_router_topk": spec.experts_per_token,
                "moe_ffn_hidden_size": spec.moe_intermediate_size,
                # top-k of the logits, then softmax over the k = renormalized top-k probabilities (norm_topk_prob);
                # without renormalization: softmax over every expert first, then top-k
                "moe_router_pre_softmax": not spec.norm_topk_prob,
                "moe_router_load_balancing_type": "none",
                "moe_aux_loss_coeff": 0.0,
                "moe_token_dispatcher_type": "allgather",
                "moe_grouped_gemm": False,
            }
        )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _mark_sharded(gpt) -> None:
    """Give each tensor-parallel shard Megatron's ``tensor_model_parallel`` attributes. Megatron sets them only
    while it initializes weights (perform_initialization), which a model loaded from a checkpoint skips, and
    its grad-norm and clipping code (clip_grads.py) count a parameter without them as a replica, once."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in gpt.modules():
        dim = (
            0
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding))
            else (1 if isinstance(module, RowParallelLinear) else None)
        )
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
        bias = getattr(module, "bias", None)
        if (
            isinstance(module, ColumnParallelLinear)
            and bias is not None
            and not getattr(bias, "tensor_model_parallel", False)
        ):
            set_tensor_model_parallel_attributes(bias, True, 0, 1)


def stable_repr(value) -> str:
    """A repr without memory addresses, so two manifests of the same run are equal: functions by their
    qualified name, partials by their function and arguments, anything else by repr with addresses cut."""
    import re

    if isinstance(value, functools.partial):
        args = [stable_repr(a) for a in value.args] + [f"{k}={stable_repr(v)}" for k, v in value.keywords.items()]
        return f"functools.partial({', '.join([stable_repr(value.func), *args])})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


ROUTING_REPLAYED = {
    "mechanism": "megatron.core.transformer.moe.router_replay.RouterReplay (REPLAY_FORWARD)",
    "weights": "softmax(router logits at the replayed experts), or with moe_router_pre_softmax the "
    "softmax over every expert gathered at them "
    "(moe_utils.topk_routing_with_score_function)",
}


class MegatronEngine(Engine):
    name = "megatron"

    @classmethod
    def check_options(cls, options):
        from megatron.core.transformer.transformer_config import TransformerConfig

        micro_batch_option(options)
        config_options = {k: v for k, v in options.items() if k != "micro_batch_size"}
        fields = {f.name: f.type for f in dataclasses.fields(TransformerConfig)}
        reject_unknown(
            "megatron",
            config_options,
            set(fields),
            "megatron accepts micro_batch_size and TransformerConfig fields "
            "(megatron/core/transformer/transformer_config.py)",
        )
        reject_wrong_types("megatron", config_options, fields)
        fixed = sorted(set(config_options) & MEGATRON_CHECKPOINT_FIELDS)
        if fixed:
            raise InputError(
                f"megatron option(s) {', '.join(fixed)} come from the checkpoint's config.json "
                "or --dtype; they cannot be overridden"
            )

    @classmethod
    def check_config(cls, spec, settings, role, mode):
        """Build the TransformerConfig and refuse any option it silently resolves to another value (e.g.
        apply_query_key_layer_scaling forces attention_softmax_in_fp32 back to true)."""
        config = cls._config(spec, settings)
        for key, value in settings.options.items():
            if key != "micro_batch_size" and getattr(config, key) != value:
                raise InputError(
                    f"megatron {key}={value!r}: TransformerConfig resolves it to {getattr(config, key)!r} "
                    "(another setting overrides it), so the run would not measure what it records; "
                    "drop it"
                )

    @staticmethod
    def _config(spec: ModelSpec, settings: EngineSettings):
        """The TransformerConfig of this run. Raises InputError with Megatron's own reason."""
        options = {k: v for k, v in settings.options.items() if k != "micro_batch_size"}
        try:
            return transformer_config(spec, settings, options)
        except (AssertionError, ValueError, TypeError) as e:
            raise InputError(
                f"megatron rejected the TransformerConfig options: {first_lines(e) or type(e).__name__}"
            ) from e

    def __init__(self, spec: ModelSpec, settings: EngineSettings):
        super().__init__(spec, settings)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.module import Float16Module

        self.micro_batch_size = micro_batch_option(settings.options)
        self.tp_size = tensor_parallel_size(settings)
        self.rank = init_parallel(settings.device, self.tp_size)
        self.config = self._config(spec, settings)
        ops = settings.strict_ops
        if ops:
            from alignaudit.engines.megatron.strict import StrictGPTModel, strict_block_spec

            require_flash(settings, spec)
            layer_spec = strict_block_spec(
                spec.num_layers,
                ops,
                spec.rope_theta,
                spec.qk_norm,
                spec.rope_llama3,
                spec.num_experts,
                settings.strict_exp,
                settings.strict_attention,
            )
            model_cls = functools.partial(StrictGPTModel, strict_ops=ops)
        else:
            layer_spec = get_gpt_layer_local_spec(
                qk_layernorm=spec.qk_norm,
                normalization="RMSNorm",
                num_experts=spec.num_experts or None,
                moe_grouped_gemm=False,
            )
            model_cls = GPTModel
        model = model_cls(
            self.config,
            layer_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            # llama3 scaling with Megatron's fixed low 1 / high 4 / original 8192 (capabilities refuses others)
            rope_scaling=spec.rope_llama3 is not None,
            rope_scaling_factor=spec.rope_llama3[0] if spec.rope_llama3 else 8.0,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            pre_process=True,
            post_process=True,
        )
        state = megatron_state_dict(spec, settings.torch_dtype, self.rank, self.tp_size)
        self.loaded_tensors = len(state)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise InputError(f"weight conversion mismatch: missing {missing}, unexpected {unexpected}")
        if self.tp_size > 1:
            _mark_sharded(model)
        if settings.lm_head_dtype == "fp32":
            self._fp32_output_layer(model, "linear" in ops)
        if self.config.bf16 or self.config.fp16:
            model = Float16Module(self.config, model)
        self.model = model.to(settings.device).eval()
        self.gpt = model.module if isinstance(model, Float16Module) else model

    @torch.no_grad()
    def prompt_logprobs(self, batch: TokenBatch) -> list[torch.Tensor]:
        return self.batched_logprobs(batch)

    def micro_batch_logprobs(self, rows: list[int], seqs: list[tuple[int, ...]]) -> list[torch.Tensor]:
        device = self.settings.device
        ids, _ = right_padded(seqs)
        # The whole sequence goes in, as RL trainers feed it; the label of the last position wraps around
        # and its loss is dropped.
        inputs, labels = ids.to(device), torch.roll(ids, -1, dims=1).to(device)
        n = inputs.shape[1]
        positions = torch.arange(n, device=device).expand_as(inputs)
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)[None, None]
        self.set_spans(rows, [len(s) for s in seqs])
        if self.routing_replay is not None:
            from alignaudit.engines.routing_replay import batch_routing

            for layer, replay in enumerate(self._router_replays):  # the router flattens [seq, batch]
                replay.clear_indices()
                replay.set_target_indices(batch_routing(self.routing_replay[layer], rows, n, seq_first=True))
        seen = self._watch_loss_logits() if self.vocab_sink is not None else None
        try:
            if self.replay is None:
                loss = self.model(inputs, positions, causal, labels=labels)  # [batch, n] fp32
            else:
                loss = self._replayed_loss(inputs, positions, causal, labels, rows, [len(s) for s in seqs])
        finally:
            self.gpt.__dict__.pop("compute_language_model_loss", None)
        if seen is not None:
            if len(seen) != 1:
                raise RuntimeError(f"full-vocabulary rows: the loss ran {len(seen)} times in one forward, not once")
            for j, (r, s) in enumerate(zip(rows, seqs, strict=True)):
                self.vocab_sink(r, seen[0][j, : len(s) - 1])
        return [-loss[j, : len(s) - 1].float() for j, s in enumerate(seqs)]

    def _watch_loss_logits(self) -> list[torch.Tensor]:
        """Until the next forward returns: the logits GPTModel hands its loss (``compute_language_model_loss``, an
        instance attribute over the class's method, removed by the caller) become log-softmax rows [batch, n, V]
        appended to the returned list, before the loss (which works in place on fp32 logits) runs."""
        seen: list[torch.Tensor] = []
        original = self.gpt.compute_language_model_loss

        def loss_and_rows(labels, logits):
            seen.append(self.log_softmax_rows(labels, logits))
            return original(labels, logits)

        self.gpt.compute_language_model_loss = loss_and_rows  # type: ignore[method-assign]  # wrapped, on this model
        return seen

    def log_softmax_rows(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax rows [b, s, V] of the logits [s, b, V] the loss receives (labels [b, s]), by the
        loss's own arithmetic so that row t's entry at label t is -loss[t] bit for bit: under strict logprobs
        alignaudit_kernels.log_softmax (the rows its token_logprobs gathers); otherwise Megatron's
        VocabParallelCrossEntropy steps (megatron/core/tensor_parallel/cross_entropy.py) on a copy: z = l - max
        with its calculate_logits_max, its calculate_predicted_logits for sum(exp(z)), then z - log(sum). One
        rank only (checks.check_full_vocab refuses tensor-parallel size > 1)."""
        logits = logits.detach()
        if "logprobs" in self.settings.strict_ops:
            import alignaudit_kernels as K

            return K.log_softmax(logits.transpose(0, 1))
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as VCE

        work, row_max = VCE.calculate_logits_max(logits.clone())  # fp32 (a copy: the loss gets the original)
        z = work - row_max.unsqueeze(-1)
        sum_exp = VCE.calculate_predicted_logits(work, labels.transpose(0, 1).contiguous(), row_max, 0, work.shape[-1])[
            3
        ]
        return (z - torch.log(sum_exp).unsqueeze(-1)).transpose(0, 1)

    def vocab_row_formula(self) -> str:
        if "logprobs" in self.settings.strict_ops:
            return "alignaudit_kernels.log_softmax of the logits GPTModel hands its loss"
        return (
            "Megatron's vocab_parallel_cross_entropy steps on the logits GPTModel hands its loss: "
            "z = logits.float() - max, then z - log(sum(exp(z)))"
        )

    def replay_routing(self, routing, lengths):
        """Megatron-Core's own router replay: each TopKRouter gets the RouterReplay that
        ``moe_enable_routing_replay`` gives it at construction, in REPLAY_FORWARD (megatron/core/transformer/moe/
        router_replay.py); the config records the flag. Raises InputError as Engine.replay_routing says."""
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        from alignaudit.engines.routing_replay import check_routing

        routers = [layer.mlp.router for layer in self.gpt.decoder.layers]
        if not all(isinstance(r, TopKRouter) for r in routers) or self.tp_size != 1:
            raise InputError(
                "megatron replays routing of its own TopKRouter only (a Qwen3 MoE model, one rank, "
                "--strict without linear)"
            )
        check_routing(routing, len(routers), self.spec.experts_per_token, self.spec.num_experts, lengths)
        self.config.moe_enable_routing_replay = True
        self.routing_replay = routing
        self._router_replays = []
        for router in routers:
            router.router_replay = RouterReplay()
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self._router_replays.append(router.router_replay)

    @staticmethod
    def _fp32_output_layer(gpt, strict: bool) -> None:
        """The output layer (or, with tied embeddings, the embedding weight it is handed) in fp32."""
        head = gpt.output_layer

        def forward(input_, weight=None, runtime_gather_output=None, **kwargs):
            return fp32_head(input_, head.weight if weight is None else weight, None, strict), None

        head.forward = forward

    def _replayed_loss(self, inputs, positions, mask, labels, rows, lengths):
        """Per-token loss [batch, n] as with ``labels``, then the generated tokens' loss recomputed under the
        sampling transform: logits from the unwrapped model (its own dtype, as the loss sees them inside),
        the same ``compute_language_model_loss`` for both (verl's Megatron actor scales logits by the
        temperature before its vocab-parallel log-probs in the same way)."""
        from alignaudit.engines.sampling import process_logits

        logits = self.gpt(inputs, positions, mask)  # [batch, n, V]
        # vocab_parallel_cross_entropy works in place on fp32 logits: give it a copy, keep ours; a contiguous one,
        # as megatron-core 0.19's views it as [-1, V] (clone() keeps the transpose's strides: it failed on the H200).
        loss = self.gpt.compute_language_model_loss(
            labels, logits.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        )
        for j, (r, length) in enumerate(zip(rows, lengths, strict=True)):
            replay = self.replay_rows(r, length)
            if replay is None:
                continue
            span, kwargs = replay
            processed = process_logits(self._whole_vocabulary(logits[j, span]), **kwargs)  # [m, V] fp32
            if self.tp_size > 1:  # top-k/top-p saw the whole vocabulary; the loss takes this rank's shard
                processed = processed.chunk(self.tp_size, -1)[self.rank]
            replayed = self.gpt.compute_language_model_loss(labels[j, span][None], processed[:, None])[0]
            loss = torch.cat(
                [loss[:j], torch.cat([loss[j, : span.start], replayed, loss[j, span.stop :]])[None], loss[j + 1 :]]
            )
        return loss

    def _whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V/t] of this rank -> [..., V], the shards gathered in rank order (at size 1: as is)."""
        if self.tp_size == 1:
            return logits
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(logits.contiguous())

    def training(self, lr: float, clip_grad: float, offload_fraction: float, adam):
        """DistributedDataParallel, megatron.core's optimizer on CUDA (alignaudit.engines.megatron.training)."""
        from alignaudit.engines.megatron.training import MegatronTraining

        return MegatronTraining(self, lr, clip_grad, offload_fraction, adam)

    def hf_weights(self, diverged: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The model's weights in HF names (weights.megatron_to_hf); collective at tensor-parallel size
        > 1, where ``diverged`` collects replicated parameters whose copies differ between ranks."""
        from alignaudit.engines.megatron.weights import megatron_to_hf

        return megatron_to_hf(self.gpt, self.spec, diverged)

    def install_taps(self, tap):
        from alignaudit.engines.megatron import taps as megatron_taps

        return megatron_taps.install(self.gpt, tap)

    def settings_record(self) -> dict:
        config = {}
        for f in dataclasses.fields(self.config):
            value = getattr(self.config, f.name)
            config[f.name] = value if isinstance(value, (bool, int, float, str, type(None))) else stable_repr(value)
        return {
            "micro_batch_size": self.micro_batch_size,
            "micro_batches": getattr(self, "micro_batches_run", None),
            "layer_spec": "alignaudit.engines.megatron.strict.strict_block_spec"
            if self.settings.strict_ops
            else "get_gpt_layer_local_spec",
            "strict": self.settings.strict,
            "attention_exp": applied_exp(self.gpt),
            "attention_kernel": applied_kernel(self.gpt),
            "float16_module": self.gpt is not self.model,
            "lm_head_dtype": "float32" if self.settings.lm_head_dtype == "fp32" else str(self.config.params_dtype),
            "module_mode": "train" if self.model.training else "eval",
            "weights": {"checkpoint_tensors": self.spec.tensors, "megatron_parameters_loaded": self.loaded_tensors},
            "logprob_formula": "-vocab_parallel_cross_entropy(logits, labels)"
            + (
                "; generated tokens: -vocab_parallel_cross_entropy(process_logits(logits, **replay), labels)"
                if self.replay is not None
                else ""
            ),
            "replay": self.replay.to_dict() if self.replay is not None else None,
            "routing_replay": ROUTING_REPLAYED if self.routing_replay is not None else None,
            "transformer_config": config,
        }


def rendezvous_file() -> str:
    """The path of a new empty file for torch.distributed's file rendezvous (``init_method="file://..."``), removed
    when this process exits, after it has joined the rank processes it started: torch's FileStore reopens the file
    by path for every store operation, and deletes it only where every rank's store is destroyed, which forked
    ranks (they leave through os._exit) never do.

    The removal is a multiprocessing finalizer of negative priority (multiprocessing.util._exit_function runs those
    after joining the children), and only the creating process removes the file: a child forked with os.fork that
    runs the exit functions (alignaudit.workers.preloaded) inherits the finalizer but not the file."""
    from multiprocessing.util import Finalize

    fd, path = tempfile.mkstemp(prefix="alignaudit-pg-")
    os.close(fd)
    Finalize(None, _remove_file, args=(path, os.getpid()), exitpriority=-1)
    return path


def _remove_file(path: str, creator: int) -> None:
    if os.getpid() == creator:
        with contextlib.suppress(OSError):
            os.unlink(path)
