"""verl with alignaudit: every step's rollouts written where verl writes its own, in a form ``alignaudit rescore`` reads
(docs/frameworks.md "verl"). Checked against verl 0.9.1 (verl/trainer/ppo/ray_trainer.py, RayPPOTrainer).

verl's own rollout dump (``trainer.rollout_data_dir``, RayPPOTrainer._log_rollout_data) holds decoded text and
scores, no token ids and no rollout logprobs. With this module's hook in verl's Ray workers, the trainer also writes
``alignaudit-step{N}.jsonl`` there, one line per rollout:

    token_ids      the prompt's tokens (left padding dropped, by the attention mask), then the response's (right
                   padding dropped, by verl's response_mask)
    prompt_length  the prompt's token count
    logprobs       the rollout engine's logprob of each response token (``batch["rollout_log_probs"]``, which verl
                   records with ``actor_rollout_ref.rollout.calculate_log_probs``)
    temperature, top_k, top_p, logprobs_mode    from ``actor_rollout_ref.rollout``: how vLLM sampled

One switch, on verl's command line (Ray runs ``setup`` in every worker process as it starts, the trainer's too):

    python -m verl.trainer.main_ppo ... trainer.use_v1=False trainer.rollout_data_dir=/data/rollouts \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=alignaudit.integrations.verl.setup
    alignaudit rescore /data/rollouts/alignaudit-step3.jsonl --model /ckpt --train hf --out runs/verl-step3

Refused when verl's trainer is built (InputError, before any step), with the reason (``check_config``): no rollout
logprobs (``calculate_log_probs`` off), a ``logprobs_mode`` other than raw_logprobs or processed_logprobs; for records
alone, verl's v1 trainer (``trainer.use_v1``, verl's default: it keeps rollouts in TransferQueue, which the records do
not read yet) or no ``rollout_data_dir`` (nothing would be written); multi-turn rollouts where records are written.

Strict (the same hook, with ``ALIGNAUDIT_STRICT=all`` among the Ray workers' environment variables, which also makes
verl's vLLM strict through alignaudit's vLLM plugin):

    +ray_kwargs.ray_init.runtime_env.env_vars.ALIGNAUDIT_STRICT=all

verl's FSDP actor and reference (verl/workers/engine/fsdp/transformer_impl.py, FSDPEngine; not the critic, whose
values are no logprobs) get the strict module swap as verl builds the transformers model, before FSDP wraps it
(``strict_module``: its forward out of verl's autocast, in FSDP's mixed-precision dtype, vLLM's); their logprobs come
from the strict kernel on fp32 logits divided by the temperature as vLLM's sampler divides them
(``strict_logprobs_from_logits``, ``strict_scale_by_temperature`` in place of verl's). Every step, right after the
actor's rescoring and before the update, verl's debug metrics gain ``alignaudit/mismatches`` and ``alignaudit/tokens``
(``check_alignment``); with ``ALIGNAUDIT_FAIL_CLOSED=1`` too, the trainer stops at the first step whose old_log_probs
differ from vLLM's rollout_log_probs in any bit, that step's records written first (verl dumps its own after the
update, which is not reached).
Both trainers, RayPPOTrainer and v1's. Refused with strict on (``check_strict_config``, each value read where verl
reads it): an actor other than FSDP (verl's Megatron actor builds through Megatron-Bridge, not patched yet), a
rollout other than vLLM, Ulysses sequence parallelism (actor or reference), fused or Liger kernels, LoRA,
quantization-aware training, a quantized rollout, padded (not packed) forward passes, a mixed-precision dtype other
than vLLM's (``engine_kwargs.vllm.dtype`` over ``rollout.dtype``, as verl's vLLM server reads them; "auto"), a
temperature other than 1 with raw logprobs (vLLM's raw logprobs are taken before the temperature, verl's actor after
it), top-k / top-p with processed logprobs (verl's actor does not truncate), and with fail-closed the rollout-correction
bypass mode (nothing is rescored to check).
Not run yet: verl's own loop with this hook (verl pins transformers < 5.11; docs/frameworks.md says what blocks it on
the GPU machines here), verl's v1 trainer (TransferQueue does not install here), and verl's FSDPEngine itself on a
CPU (its device mesh asks for CUDA): the CPU tests drive verl's own model-building, model-input and model-output code
around the strict model.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from alignaudit.errors import EXIT_MISMATCH, AlignAuditError, InputError
from alignaudit.inputs.strict_ops import ATTENTION_ENV, ENV, EXP_ENV, parse_strict

RECORDS = "alignaudit-step{step}.jsonl"
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
FAIL_CLOSED_ENV = "ALIGNAUDIT_FAIL_CLOSED"
_PATCHED: dict[str, object] = {}
_TRAINER: dict[str, Any] = {}  # "built": the trainer this process built (fail-closed writes its step records)


class AlignmentError(AlignAuditError):
    """verl's actor rescored a sampled token to other bits than vLLM recorded (``ALIGNAUDIT_FAIL_CLOSED``)."""

    exit_code = EXIT_MISMATCH


def setup() -> None:
    """Ray's ``worker_process_setup_hook``: patch verl's trainers (RayPPOTrainer, and verl's v1 PPOTrainer where this
    process can import it) so that they check their config when built (``check_config``; ``check_strict_config``
    with ALIGNAUDIT_STRICT), RayPPOTrainer writing alignaudit's records beside its own rollout dump; with
    ALIGNAUDIT_STRICT set, make verl's FSDP engine strict (``strict_fsdp_engine``) and check every step
    (``check_alignment``). Idempotent; what a process cannot import (the trainer in a rollout worker) is left alone."""
    if _PATCHED:
        return
    _PATCHED["setup"] = True
    ops = parse_strict(os.environ.get(ENV), ENV)
    fail_closed = os.environ.get(FAIL_CLOSED_ENV, "") not in ("", "0")
    if ops:
        for patch in (
            lambda: strict_fsdp_engine(ops, os.environ.get(EXP_ENV, "portable")),
            lambda: _check_every_step(fail_closed),
        ):
            try:
                patch()
            except ImportError:  # a process without verl's engine or trainer code
                pass
    for module, name in (
        ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer"),
        ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer"),
    ):
        try:
            trainer = getattr(importlib.import_module(module), name)
        except ImportError:  # verl's v1 trainer needs TransferQueue
            continue
        _check_when_built(trainer, bool(ops), fail_closed)
        if name == "RayPPOTrainer":
            _write_records_with_the_dump(trainer)


def _check_when_built(trainer: Any, strict: bool, fail_closed: bool) -> None:  # Any: a verl trainer class
    """``trainer.__init__(config, ...)`` runs check_config (and check_strict_config) before verl's own."""
    build = trainer.__init__

    @functools.wraps(build)
    def __init__(self, config, *args, **kwargs):
        check_config(config, strict)
        if strict:
            check_strict_config(config, fail_closed)
        build(self, config, *args, **kwargs)
        _TRAINER["built"] = self

    trainer.__init__ = __init__


def _write_records_with_the_dump(trainer: Any) -> None:  # Any: verl's RayPPOTrainer class
    """RayPPOTrainer._log_rollout_data (its rollout dump, where ``trainer.rollout_data_dir`` is set) also writes the
    step's records (``write_records``)."""
    dump = trainer._log_rollout_data

    @functools.wraps(dump)
    def _log_rollout_data(self, batch, reward_extra_infos_dict, timing_raw, rollout_data_dir):
        dump(self, batch, reward_extra_infos_dict, timing_raw, rollout_data_dir)
        write_records(batch, sampling(self.config), self.global_steps, rollout_data_dir)

    trainer._log_rollout_data = _log_rollout_data


def strict_fsdp_engine(ops: frozenset[str], exp: str = "portable") -> None:
    """Make verl's FSDP engine (verl/workers/engine/fsdp/transformer_impl.py) strict in this process: every language
    model FSDPEngine._build_module builds (the actor's, the reference's; not a critic's value model, whose values are
    no logprobs) gets ``strict_module``, and the module's ``logprobs_from_logits`` and
    ``_scale_logits_by_temperature`` become ``strict_logprobs_from_logits`` and ``strict_scale_by_temperature``.

    Raises:
        ImportError: verl's FSDP engine is not importable here.
    """
    from verl.workers.engine.fsdp import transformer_impl

    build = transformer_impl.FSDPEngine._build_module

    @functools.wraps(build)
    def _build_module(self):
        module = build(self)
        if getattr(self.model_config, "model_type", "language_model") == "language_model":  # not the critic's
            strict_module(module, ops, exp)
        return module

    transformer_impl.FSDPEngine._build_module = _build_module  # type: ignore[method-assign]  # the patch
    transformer_impl.logprobs_from_logits = strict_logprobs_from_logits
    transformer_impl._scale_logits_by_temperature = strict_scale_by_temperature


def strict_module(module, ops: frozenset[str], exp: str = "portable") -> list[str]:
    """The strict module swap (alignaudit.engines.hf.strict.make_strict) in a transformers model verl built, in place,
    and its forward run with autocast off (verl's forward_step runs it under ``torch.autocast``: the strict modules
    compute in their parameters' dtype, FSDP's mixed-precision one). Returns the swapped modules' names.

    Raises:
        InputError: an architecture alignaudit does not run (make_strict).
    """
    from alignaudit.engines.hf.strict import make_strict
    from alignaudit.inputs.checkpoint import load_spec

    path = getattr(module.config, "_name_or_path", "")
    llama3 = load_spec(Path(path)).rope_llama3 if (Path(path) / "config.json").is_file() else None
    swapped = make_strict(module, ops, llama3, exp)
    forward = module.forward

    @functools.wraps(forward)
    def without_autocast(*args, **kwargs):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return forward(*args, **kwargs)

    module.forward = without_autocast
    return swapped


def strict_logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True):
    """verl's ``logprobs_from_logits`` (verl/utils/torch_functional.py), strict: fp32 log p(label) of logits [n, V]
    (any float dtype) and labels [n], by alignaudit_kernels.token_logprobs on the fp32 logits, as the strict vLLM
    sampler computes its logprobs; differentiable. ``inplace_backward`` is verl's memory option, without meaning
    here."""
    import alignaudit_kernels as K

    with torch.autocast(logits.device.type, enabled=False):
        return K.token_logprobs(logits.float(), labels)


def strict_scale_by_temperature(logits: torch.Tensor, temperature: torch.Tensor, *, is_unit_temperature: bool):
    """verl's ``_scale_logits_by_temperature``, as vLLM's sampler scales (alignaudit.engines.sampling
    .scale_by_temperature: fp32 logits [n, V] divided row by row by ``temperature`` [n, 1] or [n]); at unit
    temperature the logits unchanged (a division by 1 changes no bit)."""
    from alignaudit.engines.sampling import scale_by_temperature

    if is_unit_temperature:
        return logits
    return scale_by_temperature(logits, temperature.reshape(-1))


def check_strict_config(config, fail_closed: bool = False) -> None:
    """Refuse a verl config under which verl's actor and vLLM cannot compute the same logprob bits, even strict (the
    module docstring's list), or (``fail_closed``) under which the step check cannot run: verl's rollout-correction
    bypass mode takes vLLM's logprobs as old_log_probs and never rescores. Values are read where verl reads them
    (vLLM's ``engine_kwargs`` override the rollout's own ``dtype`` and ``logprobs_mode``: verl's vLLM server spreads
    them last), dtypes in verl's spellings (verl/utils/torch_dtypes.py).

    Raises:
        InputError: naming the setting and the fix.
    """
    if os.environ.get(ATTENTION_ENV, "portable") != "portable":
        _refuse(
            f"{ATTENTION_ENV}={os.environ[ATTENTION_ENV]}: verl's strict actor computes the portable attention "
            f"kernel only, and vLLM would compute another; unset {ATTENTION_ENV}"
        )
    strategy = _select(config, "actor_rollout_ref.actor.strategy")
    if strategy not in ("fsdp", "fsdp2"):
        _refuse(
            f"actor_rollout_ref.actor.strategy={strategy}: verl's strict actor is built for FSDP (its Megatron "
            "actor builds through Megatron-Bridge, not patched yet); use fsdp2"
        )
    if _select(config, "actor_rollout_ref.rollout.name") != "vllm":
        _refuse(
            f"actor_rollout_ref.rollout.name={_select(config, 'actor_rollout_ref.rollout.name')}: the strict "
            "rollout is vLLM's (alignaudit's vLLM plugin); use vllm"
        )
    for side in ("actor", "ref"):
        for key in (
            f"actor_rollout_ref.{side}.ulysses_sequence_parallel_size",
            f"actor_rollout_ref.{side}.fsdp_config.ulysses_sequence_parallel_size",
        ):
            if (_select(config, key) or 1) != 1:
                _refuse(
                    f"{key}={_select(config, key)}: Ulysses sequence parallelism splits the strict attention's "
                    "sequences across ranks, which it does not compute yet; set it to 1"
                )
    for key, why in (
        ("actor_rollout_ref.model.use_fused_kernels", "the fused head computes its own logprobs"),
        ("actor_rollout_ref.model.use_liger", "Liger's kernels replace the modules the strict swap replaces"),
        (
            "actor_rollout_ref.actor.fsdp_config.qat.enable",
            "quantization-aware training changes the weights both engines compute with",
        ),
    ):
        if _select(config, key):
            _refuse(f"{key}=True: {why}; set it to False")
    if (_select(config, "actor_rollout_ref.model.lora_rank") or 0) > 0:
        _refuse("actor_rollout_ref.model.lora_rank > 0: LoRA's adapters are not strict modules; set lora_rank=0")
    if not _select(config, "actor_rollout_ref.model.use_remove_padding", True):
        _refuse(
            "actor_rollout_ref.model.use_remove_padding=False: the padded forward's right padding is not a layout "
            "the strict attention reads; set it to True"
        )
    if _select(config, "actor_rollout_ref.rollout.quantization"):
        _refuse(
            f"actor_rollout_ref.rollout.quantization={_select(config, 'actor_rollout_ref.rollout.quantization')}: "
            "vLLM would compute with quantized weights the actor does not hold; drop it"
        )
    if fail_closed and _select(config, "algorithm.rollout_correction.bypass_mode"):
        raise InputError(
            f"alignaudit.integrations.verl ({FAIL_CLOSED_ENV}): algorithm.rollout_correction.bypass_mode="
            "True uses vLLM's logprobs as old_log_probs, so no step rescores them to check; set it to "
            f"False or drop {FAIL_CLOSED_ENV}"
        )
    _check_dtypes(config)
    settings = sampling(config)
    if settings["logprobs_mode"] == "raw" and settings["temperature"] != 1.0:
        _refuse(
            f"temperature {settings['temperature']:g} with logprobs_mode=raw_logprobs: vLLM records logprobs "
            "before the temperature and verl's actor after it; use processed_logprobs"
        )
    if settings["logprobs_mode"] == "processed" and (settings["top_k"] > 0 or settings["top_p"] < 1.0):
        _refuse(
            "top_k / top_p with logprobs_mode=processed_logprobs: vLLM records the truncated distribution's "
            "logprobs and verl's actor does not truncate; use raw_logprobs at temperature 1, or drop the "
            "truncation"
        )


def _check_dtypes(config) -> None:
    """The actor's mixed-precision dtype (FSDP's param_dtype, what the strict modules compute in) is vLLM's."""
    from verl.utils.torch_dtypes import PrecisionType

    param = _select(config, "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", "bf16")
    rollout = _select(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.dtype") or _select(
        config, "actor_rollout_ref.rollout.dtype", "bfloat16"
    )
    if str(rollout) == "auto":
        _refuse(
            "the rollout's dtype is auto: vLLM then picks one by platform; name the actor's "
            f"({param}) in actor_rollout_ref.rollout.dtype"
        )
    if PrecisionType.to_dtype(param) != PrecisionType.to_dtype(rollout):
        _refuse(
            f"the actor computes in {param} (fsdp_config.mixed_precision.param_dtype) and vLLM in {rollout}; make "
            "them one dtype"
        )


def _select(config, key: str, default=None):
    """``key`` (dotted) of verl's config (an OmegaConf DictConfig), or ``default`` where it is absent."""
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, default=default)


def _refuse(why: str):
    raise InputError(f"alignaudit.integrations.verl (ALIGNAUDIT_STRICT): {why}")


def alignment(batch) -> dict:
    """Over verl's batch after the actor's rescoring (``old_log_probs`` and ``rollout_log_probs`` [B, R] fp32,
    ``response_mask`` [B, R]): the response tokens compared and those whose two logprobs differ in any bit."""
    data = batch.batch
    mask = data["response_mask"].bool()
    old, rolled = data["old_log_probs"].float()[mask], data["rollout_log_probs"].float()[mask]
    return {"tokens": int(mask.sum()), "mismatches": int((old.view(torch.int32) != rolled.view(torch.int32)).sum())}


def check_alignment(batch, fail_closed: bool, keep=None) -> dict:
    """``alignment`` of the step's batch. Raises AlignmentError where a token differs and ``fail_closed``, after
    ``keep(batch)`` (where given) kept the step's rollouts: the message names where (``_keep_records``)."""
    seen = alignment(batch)
    if fail_closed and seen["mismatches"]:
        kept = keep(batch) if keep else None
        raise AlignmentError(
            f"alignaudit.integrations.verl: {seen['mismatches']} of {seen['tokens']} response tokens "
            "have old_log_probs (verl's actor) other than vLLM's rollout_log_probs; stopped before "
            "the update (ALIGNAUDIT_FAIL_CLOSED)"
            + (f"; the step's rollouts are in {kept}, for alignaudit rescore" if kept else "")
        )
    return seen


def _keep_records(batch) -> Path | None:
    """The failing step's records (``write_records``), where this process built a RayPPOTrainer with a
    rollout_data_dir (verl writes its own dump only after the update, which fail-closed stops before); else None."""
    trainer = _TRAINER.get("built")
    if trainer is None:
        return None
    directory = _select(trainer.config, "trainer.rollout_data_dir")
    if not directory or _select(trainer.config, "trainer.use_v1", False):
        return None
    return write_records(batch, sampling(trainer.config), trainer.global_steps, directory)


def _check_every_step(fail_closed: bool) -> None:
    """verl's ``calculate_debug_metrics`` (verl/utils/debug/metrics.py: the trainer calls it right after the actor's
    rescoring, before the update, where rollout_log_probs exist) also reports ``alignaudit/mismatches`` and
    ``alignaudit/tokens`` and, ``fail_closed``, stops at a step with a mismatch."""
    from verl.utils.debug import metrics

    debug = metrics.calculate_debug_metrics

    @functools.wraps(debug)
    def calculate_debug_metrics(data):
        seen = check_alignment(data, fail_closed, _keep_records)
        return {**debug(data), **{f"alignaudit/{k}": v for k, v in seen.items()}}

    metrics.calculate_debug_metrics = calculate_debug_metrics
    try:  # verl's v1 trainer binds the name when it is imported
        from verl.trainer.ppo.v1 import trainer_base
    except ImportError:
        return
    trainer_base.calculate_debug_metrics = calculate_debug_metrics


def check_config(config, strict: bool = False) -> None:
    """Refuse a verl config under which the hook can do nothing it is asked: no rollout logprobs (the records and the
    step check both read them); without ``strict`` (records only) verl's v1 trainer (``trainer.use_v1``, verl's
    default: it keeps rollouts in TransferQueue, which the records do not read yet) or no ``rollout_data_dir``; records
    of multi-turn responses (tool tokens between sampled ones).

    Raises:
        InputError: naming the setting and the fix.
    """
    if not _select(config, "actor_rollout_ref.rollout.calculate_log_probs", False):
        raise InputError(
            "alignaudit.integrations.verl: actor_rollout_ref.rollout.calculate_log_probs=False: verl "
            "then records no rollout logprobs to rescore or check; set it to True"
        )
    v1 = bool(_select(config, "trainer.use_v1", False))
    if not strict and v1:
        raise InputError(
            "alignaudit.integrations.verl: trainer.use_v1=True (verl's default trainer keeps rollouts in "
            "TransferQueue, which alignaudit's records do not read yet); set trainer.use_v1=False, or "
            "add ALIGNAUDIT_STRICT=all for the strict actor and the step check, which run in both"
        )
    records = bool(_select(config, "trainer.rollout_data_dir")) and not v1
    if not strict and not records:
        raise InputError(
            "alignaudit.integrations.verl: trainer.rollout_data_dir is not set, so no record would be "
            "written; set it (the records go beside verl's own dump)"
        )
    if records and _select(config, "actor_rollout_ref.rollout.multi_turn.enable", False):
        raise InputError(
            "alignaudit.integrations.verl: actor_rollout_ref.rollout.multi_turn.enable=True puts tool "
            "tokens between sampled ones, which the records cannot hold; set it to False, or drop "
            "trainer.rollout_data_dir"
        )
    sampling(config)


def sampling(config) -> dict:
    """How verl's rollout sampled, in rescore's keys (alignaudit.inputs.rollouts.SAMPLING); the logprobs mode vLLM
    gets (``engine_kwargs.vllm.logprobs_mode`` over the rollout's own: verl's vLLM server spreads engine_kwargs last).

    Raises:
        InputError: a logprobs_mode that is no logprobs, or none.
    """
    rollout = config.actor_rollout_ref.rollout
    mode = _select(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.logprobs_mode") or rollout.get(
        "logprobs_mode", "processed_logprobs"
    )
    if mode not in LOGPROBS_MODES:
        kind = "records logits, not logprobs" if mode else "names none"
        raise InputError(
            f"alignaudit.integrations.verl: the rollout's logprobs_mode={mode!r} {kind}; use "
            f"{' or '.join(LOGPROBS_MODES)}"
        )
    return {
        "temperature": float(rollout.temperature),
        "top_k": int(rollout.top_k),
        "top_p": float(rollout.top_p),
        "logprobs_mode": LOGPROBS_MODES[mode],
    }


def rollout_rows(batch, settings: dict) -> list[dict]:
    """One rescore row per rollout of verl's ``batch`` (a DataProto: ``prompts`` [B, P] left-padded, ``responses``
    [B, R] right-padded, ``attention_mask`` [B, P + R], ``rollout_log_probs`` [B, R] fp32, ``response_mask`` [B, R]
    where present, else the attention mask's response part), with ``settings`` (``sampling``) in every row.

    Raises:
        InputError: no rollout_log_probs in the batch, or a response mask with holes (tokens the engine did not
            sample between sampled ones), naming the row.
    """
    data = batch.batch
    if "rollout_log_probs" not in data.keys():
        raise InputError(
            "alignaudit.integrations.verl: the batch has no rollout_log_probs; set "
            "actor_rollout_ref.rollout.calculate_log_probs=True"
        )
    prompts, responses = data["prompts"], data["responses"]
    width = prompts.shape[1]
    attention = data["attention_mask"].bool()
    response_mask = (data["response_mask"] if "response_mask" in data.keys() else attention[:, width:]).bool()
    rows = []
    for i in range(prompts.shape[0]):
        prompt = prompts[i][attention[i, :width]].tolist()
        kept = response_mask[i].nonzero().flatten().tolist()
        if kept != list(range(len(kept))):
            raise InputError(
                f"alignaudit.integrations.verl: rollout {i}'s response mask has holes (tokens the engine "
                "did not sample, e.g. a tool's, between sampled ones); multi-turn rollouts are not "
                "rescored"
            )
        response = responses[i][: len(kept)].tolist()
        logprobs = data["rollout_log_probs"][i][: len(kept)].float().tolist()
        rows.append({"token_ids": prompt + response, "prompt_length": len(prompt), "logprobs": logprobs, **settings})
    return rows


def write_records(batch, settings: dict, step: int, directory: str | Path) -> Path:
    """``rollout_rows`` as JSON lines in ``directory``/alignaudit-step{step}.jsonl, written whole or not at all (a
    temporary file renamed). Returns the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RECORDS.format(step=step)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rollout_rows(batch, settings)))
    os.replace(tmp, path)
    return path
