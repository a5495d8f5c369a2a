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
Not built yet: verl's actor and its vLLM computing strict (the FSDP module swap and the Megatron spec inside verl's
workers), and verl's own loop run with this hook (verl pins transformers < 5.11; docs/frameworks.md says what
blocks it on the GPU machines here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from alignaudit.errors import InputError

RECORDS = "alignaudit-step{step}.jsonl"
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
_PATCHED: dict[str, object] = {}


def setup() -> None:
    """Ray's ``worker_process_setup_hook``: patch verl's RayPPOTrainer (where this process can import it) so that it
    checks its config when built and writes alignaudit's records beside its own rollout dump. Idempotent; a process
    without verl's trainer (a rollout or actor worker) is left alone."""
    try:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    except ImportError:
        return
    if _PATCHED:
        return
    _PATCHED["__init__"], _PATCHED["_log_rollout_data"] = RayPPOTrainer.__init__, RayPPOTrainer._log_rollout_data

    def __init__(self, config, *args, **kwargs):
        check_config(config)
        _PATCHED["__init__"](self, config, *args, **kwargs)

    def _log_rollout_data(self, batch, reward_extra_infos_dict, timing_raw, rollout_data_dir):
        _PATCHED["_log_rollout_data"](self, batch, reward_extra_infos_dict, timing_raw, rollout_data_dir)
        write_records(batch, sampling(self.config), self.global_steps, rollout_data_dir)

    RayPPOTrainer.__init__, RayPPOTrainer._log_rollout_data = __init__, _log_rollout_data


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
