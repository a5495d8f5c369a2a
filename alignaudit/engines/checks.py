"""The checks on a comparison's two engine runs made before any engine starts, through each engine's kind
(alignaudit.engines.kind): options, tensor-parallel sizes, what a mixture-of-experts model cannot run, and what
the rollout engine records. Each raises InputError with one line naming the setting, the reason and the fix.
"""

from __future__ import annotations

import os

from alignaudit.engines import kind_of, names_where
from alignaudit.errors import InputError
from alignaudit.inputs.capabilities import refuse_moe


def check_runs(train, infer, mode: str) -> None:
    """Refuse settings of either engine that would not take effect as recorded (each engine's options module),
    and in rollout mode an inference engine that cannot sample.

    Args:
        train, infer: alignaudit.inputs.request.EngineRun (options, strict ops, device). mode: "prompt" or "rollout".
    Raises:
        InputError: the first refused setting: engine, name, reason, fix.
    """
    if mode == "rollout" and not kind_of(infer.engine).rolls_out:
        raise InputError(
            f"{infer.engine} does not sample rollouts; --mode rollout needs an engine that does: "
            f"{names_where(lambda k: k.rolls_out)}"
        )
    for role, run in (("train", train), ("infer", infer)):
        kind_of(run.engine).check_settings(run.settings, mode, role)


def rollout_shape(infer, sampling, spec):
    """``sampling`` (alignaudit.inputs.request.Sampling) with the rollout engine's defaults in place of the shape
    fields left None (EOS, prompt logprobs), after refusing a shape the rollout engine ``infer`` does not sample or
    an option that has no effect under it (engine kinds' rollout_shape), and stop ids that would end completions at
    an EOS of ``spec``'s checkpoint while EOS is ignored (--ignore-eos would not take effect). Raises InputError."""
    from alignaudit.inputs.checkpoint import eos_ids

    shaped = kind_of(infer.engine).rollout_shape(infer.settings, sampling)
    stops = infer.settings.options.get("stop_token_ids")
    if not shaped.stop_at_eos and isinstance(stops, list):
        ended = sorted(set(stops) & eos_ids(spec.path))
        if ended:
            raise InputError(
                f"vllm stop_token_ids holds {ended[0]}, an EOS of {spec.name}: completions would end at "
                "EOS, which --ignore-eos asks to ignore; drop it from --infer-opt stop_token_ids or use "
                "--stop-at-eos"
            )
    return shaped


def tensor_parallel_size(run) -> int:
    """The tensor-parallel size an EngineRun asks for (1 unless the engine's own option says otherwise)."""
    return kind_of(run.engine).tensor_parallel_size(run.settings)


def refuse_parallel(runs, what: str, why: str) -> None:
    """Refuse ``what`` for runs at tensor-parallel size > 1. Raises InputError naming the engine and why."""
    for run in runs:
        if tensor_parallel_size(run) != 1:
            raise InputError(f"{what} with {run.engine} at tensor parallel size > 1 is not implemented: {why}")


def check_parallel(spec, runs, device: str) -> None:
    """Refuse a tensor-parallel size the model cannot be split by, or the machine cannot hold.

    Raises:
        InputError: naming the size, what it must divide, or what the machine has.
    """
    for run in runs:
        kind = kind_of(run.engine)
        tp = tensor_parallel_size(run)
        if tp == 1:
            continue
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise InputError(f"{run.engine} {kind.tp_option}={tp!r}: expected an integer >= 1")
        kind.check_tensor_parallel(spec, tp)
        if device == "cuda":
            import torch

            have, unit = torch.cuda.device_count(), "GPUs"
        else:
            have, unit = len(os.sched_getaffinity(0)), "CPU cores"
        if tp > have:
            raise InputError(
                f"{run.engine} {kind.tp_option}={tp} needs {tp} {unit}, one per rank; this machine has {have}"
            )


def check_moe(spec, runs) -> None:
    """Refuse what a mixture-of-experts ``spec`` cannot run with these engine runs. Raises InputError."""
    if any(tensor_parallel_size(run) != 1 for run in runs):
        refuse_moe(spec, "tensor parallelism")


def processed_logprobs(run) -> bool:
    """Whether ``run`` (the rollout engine) records processed logprobs (after temperature, top-k, top-p),
    which the training side must then replay."""
    return kind_of(run.engine).records_processed_logprobs(run.settings)


def routing_observable(run) -> bool:
    """Whether ``run``'s MoE routing decisions can be read without changing what it computes."""
    return kind_of(run.engine).routing_observable(run.settings)


def check_routing_replay(spec, train, infer, mode: str, repeat: int = 1) -> None:
    """Refuse compare --replay-routing where it is undefined or cannot be done (before any engine starts): a
    dense ``spec``; rollout mode (alignaudit reads routing while scoring prompts, not while sampling); --repeat
    (the repeats run without the replayed routing); an infer engine whose routing cannot be read as it runs
    (vLLM's compiled default MoE); a train engine whose router cannot take given experts (vLLM; the strict MoE
    layer). Raises InputError: one line, the reason and the fix."""
    if not spec.num_experts:
        raise InputError(
            f"--replay-routing replays MoE routing; {spec.name} ({spec.architecture}) is dense and has "
            "none: use a mixture-of-experts model (e.g. --model qwen3-moe-tiny) or drop --replay-routing"
        )
    if mode != "prompt":
        raise InputError(
            "--replay-routing runs in prompt mode only: alignaudit records the rollout engine's routing "
            "while it scores prompts, not while it samples; drop --mode rollout"
        )
    if repeat != 1:
        raise InputError(
            "--replay-routing with --repeat is undefined (the repeats run the engines again without "
            "the replayed routing); drop --repeat"
        )
    infer_kind, train_kind = kind_of(infer.engine), kind_of(train.engine)
    if not infer_kind.routing_observable(infer.settings):
        raise InputError(
            f"--replay-routing needs the rollout engine's routing, and {infer.engine} as configured "
            "computes it where alignaudit cannot read it (vLLM's compiled default MoE); add --infer-opt "
            "enforce_eager=true, or use --infer hf"
        )
    if not train_kind.replays_routing(train.settings):
        if train_kind.trains:
            raise InputError(
                f"--replay-routing: the train engine {train.engine} with the strict MoE layer (--strict "
                "with linear) routes by its own kernel, which replays nothing; drop linear from --strict "
                "(e.g. --strict rmsnorm,rope,silu,attention,logprobs) or drop --replay-routing"
            )
        raise InputError(
            f"--replay-routing: the train engine {train.engine} cannot take given experts in its "
            "router; use --train megatron or --train hf"
        )


FULL_VOCAB_MODES = ("prompt",)


def check_full_vocab(train, infer, mode: str, replay_routing: bool = False) -> None:
    """Refuse ``--full-vocab`` where no engine run can give the rows it needs (before any engine starts).

    Defined in prompt mode only: in rollout mode the rollout engine's sampled tokens are scored while it decodes,
    by its sampler, and their rows are not captured (its processed logprobs would also be another distribution
    than the trainer's raw rows). An engine whose adapter gives no rows (EngineKind.gives_vocab_rows) and
    tensor-parallel sizes above 1 (vLLM's ranks run in processes of its own that alignaudit's hooks do not
    reach; Megatron's rows would need the sharded vocabulary gathered) are refused too.

    ``replay_routing``: compare --replay-routing is on, which does not record rows yet (refused).

    Raises:
        InputError: naming the engine or mode, why, and the fix.
    """
    if replay_routing:
        raise InputError(
            "--full-vocab with --replay-routing is not built yet (the replayed trainer's rows are not "
            "recorded); run them as two compares, or drop one"
        )
    if mode not in FULL_VOCAB_MODES:
        raise InputError(
            "--full-vocab compares teacher-forced rows: in rollout mode the rollout engine scores its "
            "sampled tokens while decoding, where alignaudit captures no rows; drop --mode rollout or "
            "--full-vocab"
        )
    for role, run in (("train", train), ("infer", infer)):
        if not kind_of(run.engine).gives_vocab_rows:
            raise InputError(
                f"--full-vocab: {run.engine} (--{role}) gives no full-vocabulary rows; choose hf, "
                "megatron or vllm, or drop --full-vocab"
            )
    refuse_parallel(
        (train, infer),
        "--full-vocab",
        "vLLM's ranks run in processes of its own that alignaudit's "
        "row hooks do not reach, and Megatron's rows would need its sharded vocabulary gathered; drop "
        "the tensor-parallel option or --full-vocab",
    )


def check_rl_full_vocab(train, infer) -> None:
    """Refuse ``rl --full-vocab`` where the rows cannot be had (before any engine starts): an engine that gives no
    full-vocabulary rows (EngineKind.gives_vocab_rows), a tensor-parallel size above 1 (as check_full_vocab), and a
    rollout engine recording processed logprobs (its rows would be those of the sampling transform, which the
    trainer replays for the token's logprob only; its rows are not recorded).

    Raises:
        InputError: naming the engine or setting, why, and the fix.
    """
    for role, run in (("train", train), ("infer", infer)):
        if not kind_of(run.engine).gives_vocab_rows:
            raise InputError(
                f"rl --full-vocab: {run.engine} (--{role}) gives no full-vocabulary rows; choose hf, "
                "megatron or vllm, or drop --full-vocab"
            )
    if processed_logprobs(infer):
        raise InputError(
            "rl --full-vocab with logprobs_mode=processed_logprobs is not built yet (the trainer replays "
            "the sampling transform for the sampled token only, not for its whole row); drop "
            "logprobs_mode or --full-vocab"
        )
    refuse_parallel(
        (train, infer),
        "rl --full-vocab",
        "vLLM's ranks run in processes of its own that alignaudit's "
        "row hooks do not reach, and Megatron's rows would need its sharded vocabulary gathered; drop "
        "the tensor-parallel option or --full-vocab",
    )


def check_parallel_op_capture(runs, forced: bool) -> None:
    """Op capture at tensor parallel size > 1: Megatron in natural mode only (its ranks gather sharded ops);
    not vLLM, whose ranks run in worker processes its hooks cannot reach.

    Raises:
        InputError: a run at tensor-parallel size > 1 that op capture cannot reach, naming the fix.
    """
    unreachable = [r for r in runs if not kind_of(r.engine).hooks_reach_ranks]
    refuse_parallel(
        unreachable,
        "op capture",
        "vLLM's ranks run in worker processes that alignaudit's hooks cannot "
        "reach; capture vLLM at size 1 (under --strict, the same bits)",
    )
    if forced:
        refuse_parallel(
            runs, "forced-mode op capture", "sharded ops would need the reference split per rank; use --mode natural"
        )
