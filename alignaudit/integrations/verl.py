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

    python -m verl.trainer.main_ppo ... trainer.rollout_data_dir=/data/rollouts \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=alignaudit.integrations.verl.setup
    alignaudit rescore /data/rollouts/alignaudit-step3.jsonl --model /ckpt --train hf --out runs/verl-step3

Refused when verl's trainer is built (InputError, before any step), with the reason: no ``rollout_data_dir`` (nothing
would be written), ``calculate_log_probs`` off (verl then records no rollout logprobs), a ``logprobs_mode`` other than
raw_logprobs or processed_logprobs (logits are no logprobs). A response with holes in its mask (multi-turn tool
tokens the engine did not sample) is refused when it is written, naming it.
Strict (the same hook, with ``ALIGNAUDIT_STRICT=all`` among the Ray workers' environment variables, which also makes
verl's vLLM strict through alignaudit's vLLM plugin):

    +ray_kwargs.ray_init.runtime_env.env_vars.ALIGNAUDIT_STRICT=all

verl's FSDP actor and reference (verl/workers/engine/fsdp/transformer_impl.py, FSDPEngine) get the strict module swap
as verl builds the transformers model, before FSDP wraps it (``strict_module``: its forward out of verl's autocast, in
FSDP's mixed-precision dtype, vLLM's); their logprobs come from the strict kernel on fp32 logits divided by the
temperature as vLLM's sampler divides them (``strict_logprobs_from_logits``, ``strict_scale_by_temperature`` in
place of verl's). With ``ALIGNAUDIT_FAIL_CLOSED=1`` too, the trainer stops at the first step whose old_log_probs
(the actor's rescoring) differ from vLLM's rollout_log_probs in any bit, before that step's update
(``check_alignment``). Refused with strict on (``check_strict_config``): an actor other than FSDP (verl's Megatron
actor builds through Megatron-Bridge, not patched yet), a rollout other than vLLM, Ulysses sequence parallelism,
fused or Liger kernels, LoRA, padded (not packed) forward passes, a mixed-precision dtype other than the rollout's,
a temperature other than 1 with raw logprobs (vLLM's raw logprobs are taken before the temperature, verl's actor
after it), top-k / top-p with processed logprobs (verl's actor does not truncate).
Not run yet: verl's own loop with this hook (verl pins transformers < 5.11; docs/frameworks.md says what blocks it on
the GPU machines here), and verl's FSDPEngine itself on a CPU (its device mesh asks for CUDA): the CPU tests drive
verl's own model-input and model-output code around the strict model.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from alignaudit.errors import EXIT_MISMATCH, AlignAuditError, InputError
from alignaudit.inputs.strict_ops import ENV, EXP_ENV, parse_strict

RECORDS = "alignaudit-step{step}.jsonl"
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
FAIL_CLOSED_ENV = "ALIGNAUDIT_FAIL_CLOSED"
_PATCHED: dict[str, object] = {}


class AlignmentError(AlignAuditError):
    """verl's actor rescored a sampled token to other bits than vLLM recorded (``ALIGNAUDIT_FAIL_CLOSED``)."""

    exit_code = EXIT_MISMATCH


def setup() -> None:
    """Ray's ``worker_process_setup_hook``: patch verl's RayPPOTrainer (where this process can import it) so that it
    checks its config when built and writes alignaudit's records beside its own rollout dump; with ALIGNAUDIT_STRICT
    set, make verl's FSDP engine strict (``strict_fsdp_engine``) and check every step (``check_alignment``).
    Idempotent; what a process cannot import (the trainer in a rollout worker) is left alone."""
    if _PATCHED:
        return
    _PATCHED["setup"] = True
    ops = parse_strict(os.environ.get(ENV), ENV)
    if ops:
        try:
            strict_fsdp_engine(ops, os.environ.get(EXP_ENV, "portable"))
        except ImportError:
            pass
    try:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    except ImportError:
        return
    _PATCHED["__init__"], _PATCHED["_log_rollout_data"] = RayPPOTrainer.__init__, RayPPOTrainer._log_rollout_data
    fail_closed = os.environ.get(FAIL_CLOSED_ENV, "") not in ("", "0")

    def __init__(self, config, *args, **kwargs):
        check_config(config)
        if ops:
            check_strict_config(config, fail_closed)
        _PATCHED["__init__"](self, config, *args, **kwargs)

    def _log_rollout_data(self, batch, reward_extra_infos_dict, timing_raw, rollout_data_dir):
        _PATCHED["_log_rollout_data"](self, batch, reward_extra_infos_dict, timing_raw, rollout_data_dir)
        write_records(batch, sampling(self.config), self.global_steps, rollout_data_dir)

    RayPPOTrainer.__init__, RayPPOTrainer._log_rollout_data = __init__, _log_rollout_data
    if ops:
        _check_every_step(fail_closed)


def strict_fsdp_engine(ops: frozenset[str], exp: str = "portable") -> None:
    """Make verl's FSDP engine (verl/workers/engine/fsdp/transformer_impl.py) strict in this process: every model
    FSDPEngine._build_module builds gets ``strict_module``, and the module's ``logprobs_from_logits`` and
    ``_scale_logits_by_temperature`` become ``strict_logprobs_from_logits`` and ``strict_scale_by_temperature``.

    Raises:
        ImportError: verl's FSDP engine is not importable here.
    """
    from verl.workers.engine.fsdp import transformer_impl

    build = transformer_impl.FSDPEngine._build_module

    @functools.wraps(build)
    def _build_module(self):
        module = build(self)
        strict_module(module, ops, exp)
        return module

    transformer_impl.FSDPEngine._build_module = _build_module
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
    bypass mode takes vLLM's logprobs as old_log_probs and never rescores.

    Raises:
        InputError: naming the setting and the fix.
    """
    ref = config.actor_rollout_ref
    actor, rollout, model = ref.actor, ref.rollout, ref.model
    refusals = (
        (actor.strategy not in ("fsdp", "fsdp2"), f"actor_rollout_ref.actor.strategy={actor.strategy}: verl's strict "
         "actor is built for FSDP (its Megatron actor builds through Megatron-Bridge, not patched yet); use fsdp2"),
        (rollout.name != "vllm", f"actor_rollout_ref.rollout.name={rollout.name}: the strict rollout is vLLM's "
         "(alignaudit's vLLM plugin); use vllm"),
        (actor.fsdp_config.get("ulysses_sequence_parallel_size", 1) != 1 or actor.get(
            "ulysses_sequence_parallel_size", 1) != 1, "Ulysses sequence parallelism splits the strict attention's "
         "sequences across ranks, which it does not compute yet; set ulysses_sequence_parallel_size=1"),
        (bool(model.get("use_fused_kernels", False)), "actor_rollout_ref.model.use_fused_kernels=True: the fused "
         "head computes its own logprobs; set it to False"),
        (bool(model.get("use_liger", False)), "actor_rollout_ref.model.use_liger=True: Liger's kernels replace the "
         "modules the strict swap replaces; set it to False"),
        (int(model.get("lora_rank", 0)) > 0, "actor_rollout_ref.model.lora_rank > 0: LoRA's adapters are not strict "
         "modules; set lora_rank=0"),
        (not model.get("use_remove_padding", True), "actor_rollout_ref.model.use_remove_padding=False: the padded "
         "forward's right padding is not a layout the strict attention reads; set it to True"),
    )
    for refused, why in refusals:
        if refused:
            raise InputError(f"alignaudit.integrations.verl (ALIGNAUDIT_STRICT): {why}")
    correction = config.get("algorithm", {}).get("rollout_correction") or {}
    if fail_closed and correction.get("bypass_mode", False):
        raise InputError(f"alignaudit.integrations.verl ({FAIL_CLOSED_ENV}): algorithm.rollout_correction.bypass_mode="
                         "True uses vLLM's logprobs as old_log_probs, so no step rescores them to check; set it to "
                         f"False or drop {FAIL_CLOSED_ENV}")
    param = str((actor.fsdp_config.get("mixed_precision") or {}).get("param_dtype", "bf16"))
    if _dtype_name(param) != _dtype_name(str(rollout.get("dtype", "bfloat16"))):
        raise InputError(f"alignaudit.integrations.verl (ALIGNAUDIT_STRICT): the actor computes in {param} "
                         f"(fsdp_config.mixed_precision.param_dtype) and vLLM in {rollout.get('dtype')}; make them "
                         "one dtype")
    settings = sampling(config)
    if settings["logprobs_mode"] == "raw" and settings["temperature"] != 1.0:
        raise InputError(f"alignaudit.integrations.verl (ALIGNAUDIT_STRICT): temperature {settings['temperature']:g} "
                         "with logprobs_mode=raw_logprobs: vLLM records logprobs before the temperature and verl's "
                         "actor after it; use processed_logprobs")
    if settings["logprobs_mode"] == "processed" and (settings["top_k"] > 0 or settings["top_p"] < 1.0):
        raise InputError("alignaudit.integrations.verl (ALIGNAUDIT_STRICT): top_k / top_p with "
                         "logprobs_mode=processed_logprobs: vLLM records the truncated distribution's logprobs and "
                         "verl's actor does not truncate; use raw_logprobs at temperature 1, or drop the truncation")


def _dtype_name(name: str) -> str:
    """bf16 / fp16 / fp32 from verl's spellings (bf16, bfloat16, torch.bfloat16, ...); the name itself otherwise."""
    short = name.lower().removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(short, short)


def alignment(batch) -> dict:
    """Over verl's batch after the actor's rescoring (``old_log_probs`` and ``rollout_log_probs`` [B, R] fp32,
    ``response_mask`` [B, R]): the response tokens compared and those whose two logprobs differ in any bit."""
    data = batch.batch
    mask = data["response_mask"].bool()
    old, rolled = data["old_log_probs"].float()[mask], data["rollout_log_probs"].float()[mask]
    return {"tokens": int(mask.sum()), "mismatches": int((old.view(torch.int32) != rolled.view(torch.int32)).sum())}


def check_alignment(batch, fail_closed: bool) -> dict:
    """``alignment`` of the step's batch. Raises AlignmentError where a token differs and ``fail_closed``."""
    seen = alignment(batch)
    if fail_closed and seen["mismatches"]:
        raise AlignmentError(f"alignaudit.integrations.verl: {seen['mismatches']} of {seen['tokens']} response tokens "
                             "have old_log_probs (verl's actor) other than vLLM's rollout_log_probs; stopped before "
                             "the update (ALIGNAUDIT_FAIL_CLOSED)")
    return seen


def _check_every_step(fail_closed: bool) -> None:
    """verl's ``calculate_debug_metrics`` (verl/utils/debug/metrics.py: the trainer calls it right after the actor's
    rescoring, before the update, where rollout_log_probs exist) also reports ``alignaudit/mismatches`` and
    ``alignaudit/tokens`` and, ``fail_closed``, stops at a step with a mismatch."""
    from verl.utils.debug import metrics

    debug = metrics.calculate_debug_metrics

    @functools.wraps(debug)
    def calculate_debug_metrics(data):
        seen = check_alignment(data, fail_closed)
        return {**debug(data), **{f"alignaudit/{k}": v for k, v in seen.items()}}

    metrics.calculate_debug_metrics = calculate_debug_metrics


def check_config(config) -> None:
    """Refuse a verl config under which no rescorable record would be written (module docstring).

    Raises:
        InputError: naming the setting and the fix.
    """
    rollout = config.actor_rollout_ref.rollout
    if not config.trainer.get("rollout_data_dir"):
        raise InputError("alignaudit.integrations.verl: trainer.rollout_data_dir is not set, so no record would be "
                         "written; set it (the records go beside verl's own dump)")
    if not rollout.get("calculate_log_probs", False):
        raise InputError("alignaudit.integrations.verl: actor_rollout_ref.rollout.calculate_log_probs=False: verl "
                         "then records no rollout logprobs to rescore; set it to True")
    sampling(config)


def sampling(config) -> dict:
    """How verl's rollout sampled, in rescore's keys (alignaudit.inputs.rollouts.SAMPLING).

    Raises:
        InputError: a logprobs_mode that is no logprobs.
    """
    rollout = config.actor_rollout_ref.rollout
    mode = rollout.get("logprobs_mode", "processed_logprobs")
    if mode not in LOGPROBS_MODES:
        raise InputError(f"alignaudit.integrations.verl: actor_rollout_ref.rollout.logprobs_mode={mode!r} records "
                         f"logits, not logprobs; use {' or '.join(LOGPROBS_MODES)}")
    return {"temperature": float(rollout.temperature), "top_k": int(rollout.top_k), "top_p": float(rollout.top_p),
            "logprobs_mode": LOGPROBS_MODES[mode]}


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
        raise InputError("alignaudit.integrations.verl: the batch has no rollout_log_probs; set "
                         "actor_rollout_ref.rollout.calculate_log_probs=True")
    prompts, responses = data["prompts"], data["responses"]
    width = prompts.shape[1]
    attention = data["attention_mask"].bool()
    response_mask = (data["response_mask"] if "response_mask" in data.keys() else attention[:, width:]).bool()
    rows = []
    for i in range(prompts.shape[0]):
        prompt = prompts[i][attention[i, :width]].tolist()
        kept = response_mask[i].nonzero().flatten().tolist()
        if kept != list(range(len(kept))):
            raise InputError(f"alignaudit.integrations.verl: rollout {i}'s response mask has holes (tokens the engine "
                             "did not sample, e.g. a tool's, between sampled ones); multi-turn rollouts are not "
                             "rescored")
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
