"""The CLI's options: typer's flags and help for each field of the request groups (alignaudit.pipelines.requests,
where the defaults and every check live), and ``grouped``, which expands a group into its options.

A command declares a parameter of a group's type and ``@grouped`` expands it into the group's options on the
command line (each field's typer option is ``OPTION_TYPES[field]``), then hands the command one instance:

    @grouped
    def compare(run: PairArgs, sampling: SamplingArgs, output: OutputArgs, clip_eps: ClipEpsOpt = 0.2): ...
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from alignaudit.pipelines.requests import GROUPS, ROLLOUT_DEFAULTS

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        metavar="MODEL",
        help="Checkpoint directory, hub id in the local HF cache, or preset name with --random-weights "
        "(Qwen3-0.6B ... Qwen3-32B, Qwen2.5-0.5B/1.5B/7B, Llama-3.2-1B/3B, Llama-3.1-8B, Qwen3-30B-A3B), or an "
        "embedded fixture: qwen3-tiny (the default), qwen3-tiny-trained (rl --reward task), qwen2-tiny, llama-tiny, "
        "qwen3-moe-tiny.",
    ),
]
RandomWeightsOpt = Annotated[
    bool,
    typer.Option(
        "--random-weights", metavar="", help="Synthesize a preset's checkpoint with random weights (once, cached)."
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for random weights, random prompts and sampling.")]
PromptsOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--prompts", metavar="FILE", help='Prompt file: JSONL with "text" or "token_ids", or plain text lines.'
    ),
]
RandomPromptsOpt = Annotated[
    Optional[int], typer.Option("--random-prompts", metavar="N", help="Use N random token-id prompts instead.")
]
PromptLenOpt = Annotated[
    Optional[int], typer.Option("--prompt-len", metavar="L", help="Tokens per random prompt (default 64).")
]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32, for both engines.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda, or auto (cuda when available).")]
# A string, not a Path: typer turns "" into Path("."), and an empty --out must be refused, not read as ".".
OutOpt = Annotated[
    Optional[str],
    typer.Option("--out", "-o", metavar="DIR", help="Output directory (default: alignaudit-runs/COMMAND-TIME)."),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        metavar="",
        help="Reuse a non-empty --out directory: alignaudit's own earlier outputs "
        "there are replaced, nothing else is touched; complete ones are kept "
        "in .alignaudit-previous/ until the new outputs are complete.",
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", metavar="", help="Stream the engine workers' logs.")]
DebugOpt = Annotated[bool, typer.Option("--debug", metavar="", help="Show tracebacks on errors.")]
TrainOpt = Annotated[
    str,
    typer.Option(
        "--train", metavar="ENGINE", help="Training engine: megatron, hf or vllm (rl trains with megatron or hf)."
    ),
]
InferOpt = Annotated[
    str,
    typer.Option(
        "--infer", metavar="ENGINE", help="Inference (rollout) engine: vllm, hf or megatron (rollouts: vllm or hf)."
    ),
]
TrainDtypeOpt = Annotated[
    Optional[str], typer.Option("--train-dtype", metavar="DTYPE", help="Override --dtype for the training engine.")
]
InferDtypeOpt = Annotated[
    Optional[str], typer.Option("--infer-dtype", metavar="DTYPE", help="Override --dtype for the inference engine.")
]
TrainSettingOpt = Annotated[
    Optional[list[str]],
    typer.Option("--train-opt", metavar="KEY=VALUE", help="Setting for the training engine (repeatable)."),
]
InferSettingOpt = Annotated[
    Optional[list[str]],
    typer.Option("--infer-opt", metavar="KEY=VALUE", help="Setting for the inference engine (repeatable)."),
]
StrictOpt = Annotated[
    Optional[str],
    typer.Option(
        "--strict",
        metavar="[OPS]",
        help="Strict kernels in every engine the command runs: --strict alone for every op, or a subset for "
        "ablation, e.g. --strict rmsnorm,rope (ops: linear, rmsnorm, rope, silu, attention, logprobs).",
    ),
]
StrictExpOpt = Annotated[
    Optional[str],
    typer.Option(
        "--strict-exp",
        metavar="EXP",
        show_default=False,
        help="The exp inside strict attention, in both engines: portable (default; the same bits on the CPU and every "
        "GPU) or native (the GPU's exp2 instruction: faster, the same bits only where one GPU architecture runs "
        "both engines; CUDA, hf and megatron).",
    ),
]
StrictAttentionOpt = Annotated[
    Optional[str],
    typer.Option(
        "--strict-attention",
        metavar="KERNEL",
        show_default=False,
        help="The kernel of strict attention, in both engines: portable (default; alignaudit's own, the same bits on "
        "the CPU and every GPU) or flash (FlashAttention-3 at one key split, vLLM's build, on Hopper GPUs: the same "
        "bits in every layout, not the portable ones). Needs attention in --strict.",
    ),
]
LmHeadOpt = Annotated[
    str,
    typer.Option(
        "--lm-head-dtype",
        metavar="DTYPE",
        help="model (the lm_head in --dtype) or "
        "fp32 (hidden states and lm_head cast to fp32, as RL trainers and vLLM's "
        "head_dtype do), for both engines.",
    ),
]
LayersOpt = Annotated[
    Optional[str], typer.Option("--layers", metavar="RANGES", help="Layers to capture, e.g. 0-3,7 (default: all).")
]
OpsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--ops",
        metavar="OPS",
        help="Canonical ops to capture, e.g. "
        "attn,o_proj (default: all; a mixture-of-experts model has router, "
        "routing, moe for gate_proj, up_proj, act, down_proj).",
    ),
]
ClipEpsOpt = Annotated[
    float,
    typer.Option(
        "--clip-eps",
        metavar="EPS",
        help="PPO clip epsilon: the clip-fraction metric's range, and in rl also the clip range of the loss.",
    ),
]
TisThresholdOpt = Annotated[
    float,
    typer.Option(
        "--tis-threshold",
        metavar="C",
        help="Importance-sampling diagnostics: the truncation C of truncated IS, token and "
        "sequence level (verl's rollout_is_threshold; > 0).",
    ),
]
MaskLowOpt = Annotated[
    float,
    typer.Option(
        "--mask-low",
        metavar="L",
        help="Importance-sampling diagnostics: masked "
        "IS (IcePop) keeps token and sequence ratios in [L, H] (0 <= L < H).",
    ),
]
MaskHighOpt = Annotated[float, typer.Option("--mask-high", metavar="H", help="The upper end of --mask-low's range.")]
GeoMaskLowOpt = Annotated[
    float,
    typer.Option(
        "--geo-mask-low",
        metavar="L",
        help="Importance-sampling diagnostics: "
        "the geometric-mean sequence mask (NeMo-RL seq-mask-tis, verl Geo-RS) "
        "keeps sequences whose exp(mean log ratio) lies in [L, H].",
    ),
]
GeoMaskHighOpt = Annotated[
    float, typer.Option("--geo-mask-high", metavar="H", help="The upper end of --geo-mask-low's range.")
]
ModeOpt = Annotated[
    str,
    typer.Option(
        "--mode",
        metavar="MODE",
        help="prompt (teacher-forced prompts) or rollout "
        "(the inference engine samples and records its logprobs; where the command "
        "runs a training engine too, it rescores the same tokens).",
    ),
]
MaxNewTokensOpt = Annotated[
    int,
    typer.Option(
        "--max-new-tokens", metavar="N", help="Rollout: tokens sampled per completion (at most, where EOS ends it)."
    ),
]
TemperatureOpt = Annotated[
    float,
    typer.Option(
        "--temperature",
        metavar="T",
        help="Rollout: sampling temperature (> 0). With vLLM's "
        "logprobs_mode=processed_logprobs the scoring side replays it "
        "(compare's training engine, capture --tokens-from).",
    ),
]
TopKOpt = Annotated[
    int,
    typer.Option(
        "--top-k",
        metavar="K",
        help="Rollout: sample from the K most likely tokens (0 = off); replayed as --temperature is.",
    ),
]
TopPOpt = Annotated[
    float,
    typer.Option("--top-p", metavar="P", help="Rollout: nucleus sampling (1.0 = off); replayed as --temperature is."),
]
GroupSizeOpt = Annotated[
    Optional[int],
    typer.Option(
        "--group-size",
        metavar="G",
        help="Rollout: completions per "
        "prompt, sampled as one request (vLLM's n), as GRPO frameworks "
        "sample a group (default 1).",
        show_default=False,
    ),
]
StopAtEosOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--stop-at-eos/--ignore-eos",
        metavar="",
        help="Rollout: "
        "EOS ends a completion, as frameworks sample (vLLM's default), "
        "or is ignored, so every completion has --max-new-tokens "
        "tokens (hf's default, the only shape it samples).",
        show_default=False,
    ),
]
PromptLogprobsOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--prompt-logprobs/--no-prompt-logprobs",
        metavar="",
        help="Rollout: the rollout engine records the prompt's "
        "logprobs too (hf's default), or the sampled tokens' only, "
        "as frameworks do (vLLM's default; vLLM then reads its "
        "prefix cache).",
        show_default=False,
    ),
]
EngineModeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--engine-mode",
        metavar="MODE",
        help="Rollout: offline (every "
        "request into vLLM's LLM at once; the default) or async "
        "(vLLM's AsyncLLM, its engine core in a process of its own, "
        "requests arriving one every --arrival-gap seconds while "
        "earlier ones decode).",
        show_default=False,
    ),
]
ArrivalGapOpt = Annotated[
    Optional[float],
    typer.Option(
        "--arrival-gap",
        metavar="S",
        help="Rollout, --engine-mode async: seconds between two requests' arrivals (default 0.02).",
        show_default=False,
    ),
]


def _unset_by_default(option, default) -> Any:  # an Annotated[...] form, which is not a type
    """``option`` as a request group's field takes it: Optional, None when not given (so that a value given in prompt
    mode is refused even where it equals the default), the rollout default named in the help instead."""
    kind, info = typing.get_args(option)
    info = copy.copy(info)
    info.help, info.show_default = f"{info.help} Default {default:g} in rollout mode.", False
    return Annotated[Optional[kind], info]


# field of a request group -> its typer option
OPTION_TYPES = {
    "model": ModelOpt,
    "random_weights": RandomWeightsOpt,
    "seed": SeedOpt,
    "prompts": PromptsOpt,
    "random_prompts": RandomPromptsOpt,
    "prompt_len": PromptLenOpt,
    "train": TrainOpt,
    "infer": InferOpt,
    "dtype": DtypeOpt,
    "train_dtype": TrainDtypeOpt,
    "infer_dtype": InferDtypeOpt,
    "device": DeviceOpt,
    "train_opt": TrainSettingOpt,
    "infer_opt": InferSettingOpt,
    "strict": StrictOpt,
    "strict_exp": StrictExpOpt,
    "strict_attention": StrictAttentionOpt,
    "lm_head_dtype": LmHeadOpt,
    "mode": ModeOpt,
    **{
        field: _unset_by_default(option, ROLLOUT_DEFAULTS[field])
        for field, option in (
            ("max_new_tokens", MaxNewTokensOpt),
            ("temperature", TemperatureOpt),
            ("top_k", TopKOpt),
            ("top_p", TopPOpt),
        )
    },
    "group_size": GroupSizeOpt,
    "stop_at_eos": StopAtEosOpt,
    "prompt_logprobs": PromptLogprobsOpt,
    "engine_mode": EngineModeOpt,
    "arrival_gap": ArrivalGapOpt,
    "out": OutOpt,
    "force": ForceOpt,
    "verbose": VerboseOpt,
    "tis_threshold": TisThresholdOpt,
    "mask_low": MaskLowOpt,
    "mask_high": MaskHighOpt,
    "geo_mask_low": GeoMaskLowOpt,
    "geo_mask_high": GeoMaskHighOpt,
}


def grouped(fn):
    """Expand parameters annotated with an option group into the group's options (typer reads
    ``__signature__``), add ``--debug`` (read by cli.main), and call ``fn`` with one instance per group."""
    hints = typing.get_type_hints(fn, include_extras=True)
    groups, expanded = {}, []
    for name, param in inspect.signature(fn).parameters.items():  # in signature order, groups expanded in place
        cls = hints.get(name)
        if cls in GROUPS:
            groups[name] = cls
            expanded += [
                inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=OPTION_TYPES[f.name]
                )
                for f in dataclasses.fields(cls)
            ]
        else:
            expanded.append(
                param.replace(annotation=hints.get(name, param.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
            )
    expanded.append(inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=DebugOpt))

    @functools.wraps(fn)
    def wrapper(**kwargs):
        kwargs.pop("debug", None)
        for name, cls in groups.items():
            kwargs[name] = cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls)})
        return fn(**kwargs)

    wrapper.__signature__ = inspect.Signature(expanded)
    return wrapper


def field_names(*groups: type) -> list[str]:
    return [f.name for cls in groups for f in dataclasses.fields(cls)]


def given_options(ctx: typer.Context, names: list[str]) -> list[str]:
    """Of ``names``, the parameters the user gave on the command line (not left at their defaults)."""
    return [n for n in names if (source := ctx.get_parameter_source(n)) is not None and source.name != "DEFAULT"]
